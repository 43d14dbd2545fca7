"""The sim-vs-live benchmark's calibration: serving overhead from two /metrics scrapes."""

from __future__ import annotations

import pytest

from slipstream.bench.sim_vs_live import PRESETS, serving_overhead_ms, workload
from slipstream.agent.scheduler.profile_table import ProfileMeta

META = ProfileMeta(num_layers=4, host_overhead_ms=0.2, host_per_sequence_ms=0.01)


def scrape(iterations: float, actual_s: float, predicted_s: float, chunks: float,
           decodes: float) -> dict[str, float]:
    return {"slipstream_batch_time_actual_seconds_count": iterations,
            "slipstream_batch_time_actual_seconds_sum": actual_s,
            "slipstream_batch_time_predicted_seconds_sum": predicted_s,
            "slipstream_prefill_chunk_tokens_count": chunks,
            'slipstream_scheduled_tokens_total{phase="decode"}': decodes,
            'slipstream_scheduled_tokens_total{phase="prefill"}': 12345.0}


def test_overhead_is_the_extra_execution_time_beyond_the_runner_prediction():
    before = scrape(10, 0.05, 0.04, 10, 0)  # a warm-up that must be subtracted
    # 100 iterations, 200 prefill chunks and 800 decodes: 1,000 sequences. The prediction
    # (1.0 s) holds 100 * 0.2 + 1000 * 0.01 = 30 ms of host work that the metric does not time.
    after = scrape(110, 0.05 + 1.27, 0.04 + 1.0, 210, 800)
    # Runner share predicted: 970 ms; measured: 1,270 ms; 300 ms over 100 iterations.
    assert serving_overhead_ms(before, after, META) == pytest.approx(3.0)


def test_a_server_faster_than_predicted_adds_nothing_and_no_iterations_is_an_error():
    assert serving_overhead_ms({}, scrape(10, 0.01, 0.1, 5, 5), META) == 0.0
    with pytest.raises(RuntimeError):
        serving_overhead_ms({}, scrape(0, 0, 0, 0, 0), META)


def test_workload_respects_the_preset_caps_and_seeds_differ():
    preset = PRESETS["100m"]
    calibration, compared = workload(preset, 1, 50, 2.0), workload(preset, 2, 50, 2.0)
    assert len(compared) == 50
    assert max(r.output_tokens for r in compared) <= preset.max_output_tokens
    assert max(r.prompt_tokens for r in compared) <= preset.max_prompt_tokens
    assert [r.prompt_tokens for r in calibration] != [r.prompt_tokens for r in compared]
