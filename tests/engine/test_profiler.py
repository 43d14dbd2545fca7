"""`slipstream profile` on the tiny model writes a profile the runtime predictor can load, and
its engine-step calibration times real LLMEngine steps."""

from __future__ import annotations

import numpy as np

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.profile.profiler import ProfileGrid, calibration_batches, profile
from slipstream.agent.engine.profile.step_calibration import (
    CalibrationLoad, StepTiming, fastest_steps, fit_host_overhead, time_engine_steps)
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.predictor import RuntimePredictor

SMALL_LOAD = CalibrationLoad(waves=(1, 3), prompt_tokens=(16, 64), output_tokens=(4, 8))
SMALL_GRID = ProfileGrid(tokens=(1, 16, 128), prefill_kv=(0, 256), prefill_chunk=(32, 128),
                         decode_batch=(1, 8), decode_kv=(256, 1024), calibration_batches=3,
                         engine_load=SMALL_LOAD)


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
    # Scheduling and output processing always cost something: the host fit cannot be empty.
    meta = predictor.meta
    assert meta.host_overhead_ms + meta.host_per_sequence_ms > 0
    runner_only = RuntimePredictor.from_directory(out, cache_dir=None,
                                                  include_host_overhead=False)
    assert runner_only.iteration_overhead_ms == meta.iteration_overhead_ms
    # The KV tiers' bandwidths, which LARS and the packer price loads with.
    assert meta.host_load_gb_per_s > 0 and meta.disk_read_gb_per_s > 0


def test_engine_steps_are_timed_whole_and_cover_every_batch_size(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=256))
    load = CalibrationLoad(waves=(1, 4), prompt_tokens=(8, 32), output_tokens=(5, 5))
    timings = time_engine_steps(engine, load)
    assert not engine.has_unfinished()
    assert engine.on_step is None  # the hook is handed back
    # Prompts fit one chunk: per wave, one prefill step and four decode steps.
    assert [t.sequences for t in timings] == [1] * 5 + [4] * 5
    assert all(t.step_ms > t.execute_ms > 0 for t in timings)
    # Greedy, as the live steps it predicts: a temperature draw per row is not in the profile.
    assert all(chunk.sampling.greedy for t in timings if t.batch is not None
               for chunk in t.batch.chunks)
    fixed_ms, per_sequence_ms = fit_host_overhead(timings)
    assert fixed_ms >= 0 and per_sequence_ms >= 0
    assert fixed_ms + 4 * per_sequence_ms < max(t.step_ms for t in timings)
    # Another salt: the same batches (what a warm-up must cover) from other prompt tokens,
    # which the prefix cache has not seen.
    # The order of the chunks inside a step may differ (requests that arrive together tie).
    salted = time_engine_steps(engine, load, tokens_salt=1)
    assert [sorted((c.num_tokens, c.start_pos) for c in t.batch.chunks) for t in salted] == \
        [sorted((c.num_tokens, c.start_pos) for c in t.batch.chunks) for t in timings]
    assert salted[0].batch.chunks[0].token_ids != timings[0].batch.chunks[0].token_ids


def test_random_calibration_batches_sample_greedily():
    batches = calibration_batches(np.random.default_rng(0), 8, 512)
    assert all(chunk.sampling.greedy for batch in batches for chunk in batch.chunks)


def _decodes(kv_lens: list[int]) -> Batch:
    return Batch(chunks=tuple(ScheduledChunk(f"r{i}", (7,), kv - 1, (i,), True)
                              for i, kv in enumerate(kv_lens)))


def test_runs_of_the_same_batches_keep_each_steps_fastest():
    batches = [_decodes([9]), _decodes([10, 20]), _decodes([21, 11])]
    quiet = [StepTiming(len(b.chunks), 2.0 * len(b.chunks), 1.5 * len(b.chunks), b)
             for b in batches]
    # Another process slowed the first run's last step and the second run's first one; the
    # second run packed its last step's requests in another order.
    loaded = [quiet[0], quiet[1], StepTiming(2, 40.0, 39.0, batches[2])]
    reordered = [StepTiming(1, 30.0, 29.0, batches[0]), quiet[1],
                 StepTiming(2, 4.0, 3.0, _decodes([11, 21]))]
    fastest = fastest_steps([loaded, reordered])
    assert [t.step_ms for t in fastest] == [2.0, 4.0, 4.0]
    # Runs that formed other batches are pooled, not paired.
    other = [StepTiming(1, 2.0, 1.5, _decodes([5]))] * 3
    assert len(fastest_steps([loaded, other])) == 6


def test_host_fit_uses_the_time_outside_the_runner():
    # Steps of 1..8 sequences whose execution grows fast but whose host part is 0.2 + 0.05 n.
    timings = [StepTiming(n, 3.0 * n + 0.2 + 0.05 * n, 3.0 * n) for n in range(1, 9)] * 2
    fixed_ms, per_sequence_ms = fit_host_overhead(timings)
    assert abs(fixed_ms - 0.2) < 1e-6 and abs(per_sequence_ms - 0.05) < 1e-6
