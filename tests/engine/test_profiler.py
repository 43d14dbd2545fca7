"""`slipstream profile` on the tiny model writes a profile the runtime predictor can load."""

from __future__ import annotations

from slipstream.agent.engine.profiler import ProfileGrid, profile
from slipstream.agent.scheduler.predictor import RuntimePredictor

SMALL_GRID = ProfileGrid(tokens=(1, 16, 128), prefill_kv=(0, 256), prefill_chunk=(32, 128),
                         decode_batch=(1, 8), decode_kv=(256, 1024), calibration_batches=3)


def test_profile_writes_a_loadable_monotone_profile(tiny_model_dir, tmp_path):
    out = profile(tiny_model_dir, "cpu", tmp_path / "profile", repeats=2, grid=SMALL_GRID)
    predictor = RuntimePredictor.from_directory(out, cache_dir=None)
    assert predictor.meta.num_layers == 4 and predictor.meta.device == "cpu"
    assert predictor.iteration_overhead_ms >= 0
    assert 0 < predictor.linear_ms(16) <= predictor.linear_ms(128) < predictor.linear_ms(1024)
    assert 0 < predictor.prefill_attention_ms(0, 32) <= predictor.prefill_attention_ms(256, 128)
    assert 0 < predictor.decode_attention_ms(1, 256) <= predictor.decode_attention_ms(8, 1024)
    names = {path.name for path in out.iterdir()}
    assert {"profile.json", "attn_prefill.csv", "attn_decode.csv", "mlp_up_proj.csv"} <= names
