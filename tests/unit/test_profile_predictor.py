"""Profile tables and the runtime predictor: real H100 tables and hand-written ones."""

from pathlib import Path

import numpy as np
import pytest

from slipstream.sim.datasets import H100_LLAMA3_8B_TP8_DIR
from slipstream.agent.scheduler.predictor import (
    BatchTimeEstimate,
    RuntimePredictor,
    predict_batch_time_ms,
)
from slipstream.agent.scheduler.profile_table import (
    VIDUR_H100_LLAMA3_8B_TP8,
    ProfileMeta,
    load_profile,
    write_profile,
)


H100_DIR = H100_LLAMA3_8B_TP8_DIR


@pytest.fixture(scope="module")
def h100_tables():
    return load_profile(H100_DIR, meta=VIDUR_H100_LLAMA3_8B_TP8)


@pytest.fixture(scope="module")
def h100(h100_tables):
    return RuntimePredictor(h100_tables)


def small_profile(directory: Path, iteration_overhead_ms: float = 0.0, **meta_fields) -> Path:
    tokens = np.arange(1, 65)
    kv = np.arange(0, 1025, 256)
    chunks = np.arange(32, 129, 32)
    batches = np.arange(1, 5)
    tables = {
        "mlp_up_proj": np.column_stack([tokens, 0.01 + 0.001 * tokens]),
        "input_layernorm": np.column_stack([tokens, 0.002 + 0.0001 * tokens]),
        "attn_prefill": np.array([(k, c, 0.005 + 1e-6 * c * (k + c / 2)) for k in kv for c in chunks]),
        "attn_decode": np.array([(b, k, 0.004 + 0.001 * b + 2e-6 * k) for b in batches for k in kv]),
    }
    meta = ProfileMeta(num_layers=2, device="cpu", tp=1, model={"hidden_size": 64},
                       iteration_overhead_ms=iteration_overhead_ms, **meta_fields)
    return write_profile(directory, tables, meta)


def test_written_profile_loads_back_and_hits_table_points_exactly(tmp_path):
    directory = small_profile(tmp_path / "profile", iteration_overhead_ms=0.5)
    predictor = RuntimePredictor.from_directory(directory, cache_dir=tmp_path / "cache")
    assert predictor.num_layers == 2
    assert predictor.linear_ms(40) == pytest.approx(2 * ((0.01 + 0.04) + (0.002 + 0.004)))
    assert predictor.prefill_attention_ms(512, 64) == pytest.approx(2 * (0.005 + 1e-6 * 64 * 544))
    assert predictor.decode_attention_ms(3, 768) == pytest.approx(2 * (0.004 + 0.003 + 2e-6 * 768))
    # The second load comes from the .npz cache and predicts the same.
    again = RuntimePredictor.from_directory(directory, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").glob("*.npz"))
    assert again.prefill_attention_ms(300, 40) == predictor.prefill_attention_ms(300, 40)
    batch_ms = predict_batch_time_ms(predictor, [(64, 576)], [100, 200])
    expected = (0.5 + predictor.linear_ms(66) + predictor.prefill_attention_ms(512, 64)
                + predictor.decode_attention_ms(2, 300))
    assert batch_ms == pytest.approx(expected)


def test_engine_host_overhead_is_part_of_a_step_unless_only_the_runner_is_asked_for(tmp_path):
    directory = small_profile(tmp_path / "profile", iteration_overhead_ms=0.5,
                              per_sequence_overhead_ms=0.1, host_overhead_ms=0.3,
                              host_per_sequence_ms=0.02)
    step = RuntimePredictor.from_directory(directory, cache_dir=None)
    runner = RuntimePredictor.from_directory(directory, cache_dir=None,
                                             include_host_overhead=False)
    prefills, decodes = [(64, 576), (32, 32)], [100, 200, 300]
    # Five sequences: the host adds 0.3 ms per step and 0.02 ms per sequence.
    difference = (predict_batch_time_ms(step, prefills, decodes)
                  - predict_batch_time_ms(runner, prefills, decodes))
    assert difference == pytest.approx(0.3 + 5 * 0.02)
    assert runner.iteration_overhead_ms == 0.5 and runner.per_sequence_overhead_ms == 0.1


def test_the_prefill_token_overhead_is_charged_per_chunk_token(tmp_path):
    plain = RuntimePredictor.from_directory(small_profile(tmp_path / "a"), cache_dir=None)
    charged = RuntimePredictor.from_directory(
        small_profile(tmp_path / "b", per_prefill_token_overhead_ms=0.004), cache_dir=None)
    prefills, decodes = [(64, 576), (32, 32)], [100, 200, 300]
    assert (predict_batch_time_ms(charged, prefills, decodes)
            - predict_batch_time_ms(plain, prefills, decodes)) == pytest.approx(0.004 * 96)
    assert charged.decode_attention_ms(3, 600) == plain.decode_attention_ms(3, 600)


def test_profile_without_meta_is_refused(tmp_path):
    directory = small_profile(tmp_path / "profile")
    (directory / "profile.json").unlink()
    with pytest.raises(FileNotFoundError):
        load_profile(directory, cache_dir=None)


def test_extrapolation_is_monotone_and_follows_the_analytic_shape(tmp_path):
    predictor = RuntimePredictor.from_directory(small_profile(tmp_path / "p"), cache_dir=None)
    linear = [predictor.linear_ms(n) for n in (1, 32, 64, 128, 1024)]
    assert linear == sorted(linear)
    assert predictor.linear_ms(128) == pytest.approx(2 * predictor.linear_ms(64))
    prefill = [predictor.prefill_attention_ms(kv, 256) for kv in (0, 1024, 4096, 65536)]
    assert prefill == sorted(prefill) and prefill[-1] > prefill[1]
    decode = [predictor.decode_attention_ms(b, 4096) for b in (1, 4, 8, 64)]
    assert decode == sorted(decode) and decode[-1] > decode[1]


def test_h100_interpolation_equals_table_points(h100_tables, h100):
    layers = VIDUR_H100_LLAMA3_8B_TP8.num_layers
    kv, chunk, prefill_ms = h100_tables.prefill_attention
    envelope = np.maximum.accumulate(np.maximum.accumulate(prefill_ms, axis=0), axis=1)
    rng = np.random.default_rng(0)
    for i, j in zip(rng.integers(0, len(kv), 50), rng.integers(0, len(chunk), 50)):
        assert h100.prefill_attention_ms(int(kv[i]), int(chunk[j])) == pytest.approx(
            envelope[i, j] * layers, rel=1e-12)
    batch, kv_total, decode_ms = h100_tables.decode_attention
    envelope = np.maximum.accumulate(np.maximum.accumulate(decode_ms, axis=0), axis=1)
    for i, j in zip(rng.integers(0, len(batch), 50), rng.integers(0, len(kv_total), 50)):
        assert h100.decode_attention_ms(int(batch[i]), int(kv_total[j])) == pytest.approx(
            envelope[i, j] * layers, rel=1e-12)
    # Where the raw table is already monotone the envelope is the raw value itself.
    assert h100.prefill_attention_ms(0, 4096) == pytest.approx(prefill_ms[0, -1] * layers)


def test_h100_extrapolates_beyond_the_profiled_range(h100):
    assert h100.linear_profiled_max_tokens == 4096
    assert h100.linear_ms(8192) == pytest.approx(2 * h100.linear_ms(4096))
    assert h100.linear_ms(4097) > h100.linear_ms(4096)
    # Past 4096-token chunks and 2M-token contexts, attention keeps growing with kv x chunk.
    assert h100.prefill_attention_ms(65536, 8192) > 1.9 * h100.prefill_attention_ms(65536, 4096)
    at_edge = h100.prefill_attention_ms(2**21, 512)
    assert h100.prefill_attention_ms(2**22, 512) == pytest.approx(
        at_edge * (2**22 + 256) / (2**21 + 256))
    assert h100.decode_attention_ms(300, 2**22) > h100.decode_attention_ms(128, 2**21)
    grid = [h100.prefill_attention_ms(kv, c) for kv in (0, 10_000, 300_000, 3_000_000)
            for c in (32, 1000, 5000)]
    assert all(value > 0 for value in grid)


def test_h100_prediction_is_microseconds(h100):
    import timeit

    estimate = BatchTimeEstimate(h100)
    estimate.add_decodes(256, 256 * 2000)
    calls = 2000
    seconds = timeit.timeit(lambda: estimate.time_with_prefill_ms(70_000, 512), number=calls)
    assert seconds / calls < 50e-6  # generous: a few microseconds on an idle core
