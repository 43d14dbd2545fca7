"""Trace readers, synthetic arrivals and the Medha mixed-workload recipe."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slipstream.sim.traces import (
    arrival_times,
    mean_qps,
    read_azure_csv,
    read_length_file,
    read_mooncake_jsonl,
    scale_to_qps,
)
from slipstream.sim.workloads import (
    MEDHA_LONG_MAX_TOKENS,
    MEDHA_LONG_MIN_TOKENS,
    WorkloadSpec,
    build_workload,
    medha_mixed,
)


def test_azure_reader_makes_arrivals_relative_and_sorted(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:16:46.6805900,0,7\n")
    requests = read_azure_csv(path)
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 4.314579, 60.0])
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [(374, 44), (396, 109), (1, 7)]


def test_mooncake_reader_converts_milliseconds(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 1500, "input_length": 6758, "output_length": 500, "hash_ids": [0]},
            {"timestamp": 500, "input_length": 20, "output_length": 3, "hash_ids": [1]}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    requests = read_mooncake_jsonl(path)
    assert [r.arrival_s for r in requests] == [0.0, 1.0]
    assert requests[1].prompt_tokens == 6758 and requests[1].output_tokens == 500


def test_length_file_reader(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
                    "3772,54,3826,69.8\n2015,156,2171,12.9\n")
    assert read_length_file(path) == [(3772, 54), (2015, 156)]


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gamma_arrivals_have_the_requested_mean_rate(burstiness):
    times = arrival_times(np.random.default_rng(1), 20_000, qps=5.0, burstiness=burstiness)
    assert times[0] == 0.0
    assert mean_qps_of(times) == pytest.approx(5.0, rel=0.05)
    gaps = np.diff(times)
    # Coefficient of variation of gamma gaps is 1/sqrt(shape): burstier means more variable.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def mean_qps_of(times: np.ndarray) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


def test_scale_to_qps_keeps_lengths_and_order(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:{10 + i // 60:02d}:{i % 60:02d}.0000000,{100 + i},{i + 1}\n"
        for i in range(0, 120, 3)))
    requests = read_azure_csv(path)
    scaled = scale_to_qps(requests, 2.0)
    assert mean_qps(scaled) == pytest.approx(2.0)
    assert [r.prompt_tokens for r in scaled] == [r.prompt_tokens for r in requests]


SHORT_LENGTHS = [(100, 10), (2000, 300), (8000, 900)]


def test_medha_recipe_has_five_percent_long_requests_in_range():
    requests = medha_mixed(2000, qps=1.0, seed=3, short_lengths=SHORT_LENGTHS)
    long = [r for r in requests if r.source == "medha-long"]
    assert len(long) == 100
    assert all(MEDHA_LONG_MIN_TOKENS <= r.prompt_tokens <= MEDHA_LONG_MAX_TOKENS for r in long)
    short = [r for r in requests if r.source != "medha-long"]
    assert {(r.prompt_tokens, r.output_tokens) for r in short} <= set(SHORT_LENGTHS)
    # Log-uniform prompts: the median is near sqrt(128K * 1M) = 362K.
    assert 250_000 < np.median([r.prompt_tokens for r in long]) < 500_000


def test_medha_recipe_is_deterministic_by_seed():
    first = medha_mixed(300, 1.0, seed=7, short_lengths=SHORT_LENGTHS)
    again = medha_mixed(300, 1.0, seed=7, short_lengths=SHORT_LENGTHS)
    other = medha_mixed(300, 1.0, seed=8, short_lengths=SHORT_LENGTHS)
    assert first == again
    assert first != other


def test_real_traces_load():
    azure = build_workload(WorkloadSpec(trace="azure"))
    assert len(azure) > 19_000 and azure[0].arrival_s == 0.0
    assert 3000 < azure[-1].arrival_s < 3700  # one hour
    mooncake = build_workload(WorkloadSpec(trace="mooncake", qps=2.0))
    assert mean_qps(mooncake) == pytest.approx(2.0)
    mixed = build_workload(WorkloadSpec(recipe="medha-mixed", qps=1.0, num_requests=400))
    assert sum(r.source == "medha-long" for r in mixed) == 20
    lengths = build_workload(WorkloadSpec(lengths=(("sharegpt", 0.5), ("arxiv", 0.5)),
                                          qps=2.0, duration_s=100.0))
    assert {r.source for r in lengths} == {"sharegpt", "arxiv"}
    assert all(r.arrival_s < 100.0 for r in lengths)
