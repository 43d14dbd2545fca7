"""The autoscaled fleet in the simulator: decide_scale drives the count, drains lose nothing,
instance-seconds are billed from the decision to the end of the drain; and the trace warp
that gives a recorded trace a daily or step-shaped rate."""

from __future__ import annotations

import numpy as np
import pytest

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.sim.autoscale import simulate_fleet
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.simulator import SimConfig
from slipstream.sim.traces import (
    TraceRequest, diurnal_rate, merge_streams, step_rate, warp_to_rate)
from slipstream.crds.servingreplica import ServingReplicaSpec

MODEL = AnalyticModel(ms_per_token=0.05, ms_per_attended_pair=1e-7,
                      ms_per_decode_kv_token=1e-5, iteration_overhead_ms=0.5)


def config(horizon_s: float) -> SimConfig:
    return SimConfig(scheduler=SchedulerConfig(policy="fcfs", target_batch_time_ms=20.0),
                     instance=InstanceConfig(num_kv_blocks=8192), horizon_s=horizon_s)


def spec(**autoscaling) -> ServingReplicaSpec:
    return ServingReplicaSpec.model_validate({
        "model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "a",
        "autoscaling": {"minInstances": 1, "maxInstances": 6, "periodSeconds": 5,
                        "scaleDownStabilizationSeconds": 20, **autoscaling}})


def steady(qps: float, duration_s: float, prompt: int = 400, output: int = 20
           ) -> list[TraceRequest]:
    return [TraceRequest(i / qps, prompt, output) for i in range(int(qps * duration_s))]


def test_static_fleet_bills_every_instance_for_the_whole_run():
    result = simulate_fleet(steady(5, 60), config(90.0), MODEL, instances=3, bill_until_s=60)
    assert result.instance_seconds == pytest.approx(3 * 60.0)
    assert all(r.finished_s is not None for r in result.records)
    assert result.decisions == []


def test_a_warm_up_is_not_billed():
    # The study serves a warm-up before the measured part: billing starts at its end, for the
    # instances running then (3 static ones), and an instance that stopped before it costs 0.
    result = simulate_fleet(steady(5, 60), config(90.0), MODEL, instances=3, bill_from_s=20,
                            bill_until_s=60)
    assert result.instance_seconds == pytest.approx(3 * 40.0)
    scaled = simulate_fleet(steady(2, 120), config(150.0), MODEL, instances=4, spec=spec(),
                            tpot_slo_s=0.2, bill_from_s=100.0, bill_until_s=150.0)
    assert all(p["instances"] == 1 for p in scaled.timeline if p["time_s"] >= 100.0)
    assert scaled.instance_seconds == pytest.approx(50.0)  # only the one left at 100 s


def test_prompts_share_only_what_their_hash_ids_share():
    # Trace requests without hash ids share no prompt tokens: the prefix cache must find
    # nothing (each record needs its own serial, else every prompt reads as the same tokens).
    # Two that carry the same hash ids share that block.
    requests = steady(5, 20, prompt=600) + [
        TraceRequest(20.0 + i, 1024, 5, hash_ids=(7, 8)) for i in range(2)]
    result = simulate_fleet(requests, config(40.0), MODEL, instances=1)
    plain = [r for r in result.records if not r.hash_ids]
    assert all(r.finished_s is not None for r in result.records)
    assert sum(r.cached_tokens for r in plain) == 0
    shared = sorted((r for r in result.records if r.hash_ids), key=lambda r: r.arrival_s)
    assert shared[1].cached_tokens > 0


def test_light_load_scales_down_to_min_and_loses_nothing():
    result = simulate_fleet(steady(2, 120), config(150.0), MODEL, instances=4, spec=spec(),
                            tpot_slo_s=0.2)
    assert all(r.finished_s is not None for r in result.records), "a drain lost a request"
    assert result.decisions and all(d["reason"] == "ScaleDown" for d in result.decisions)
    assert result.timeline[-1]["instances"] == 1
    # Nothing comes down before the 20 s window is covered.
    assert min(d["time_s"] for d in result.decisions) >= 20.0
    assert result.instance_seconds < 4 * 150.0 * 0.5


def test_overload_scales_up_and_new_instances_serve_after_startup():
    # ~2x what one instance prefills: the autoscaler adds instances, which take requests only
    # once their startup is over.
    requests = steady(60, 120, prompt=2000, output=5)
    result = simulate_fleet(requests, config(200.0), MODEL, instances=1,
                            spec=spec(maxStep=1), startup_s=15.0)
    ups = [d for d in result.decisions if d["reason"] == "ScaleUp"]
    assert ups, "overload never scaled up"
    first_up_s = ups[0]["time_s"]
    served_by_new = [r for r in result.records if r.instance > 0]
    assert served_by_new
    assert min(r.arrival_s for r in served_by_new) >= first_up_s + 15.0
    assert max(p["instances"] for p in result.timeline) <= 6


def test_warp_follows_the_step_and_keeps_the_trace_lengths():
    trace = [TraceRequest(0.5 * i + (0.2 if i % 3 else 0.0), 100 + i, 7) for i in range(400)]
    warped = warp_to_rate(trace, step_rate(2.0, 8.0, 100.0, 200.0), 300.0)
    arrivals = np.array([r.arrival_s for r in warped])
    low = np.sum(arrivals < 100) + np.sum(arrivals >= 200)
    high = np.sum((arrivals >= 100) & (arrivals < 200))
    assert high / 100 == pytest.approx(8.0, rel=0.05)
    assert low / 200 == pytest.approx(2.0, rel=0.05)
    assert [r.prompt_tokens for r in warped[:400]] == [r.prompt_tokens for r in trace]
    assert len(warped) > len(trace)  # the trace repeats to fill the curve
    assert np.all(np.diff(arrivals) >= 0)


def test_merged_streams_keep_the_lengths_and_smooth_the_content_drift():
    # A trace whose prompts drift (short for its first half, long for its second): one copy
    # replayed faster keeps the drift; four copies side by side, each a quarter apart, have
    # four times the rate, the same lengths, and a mix of both halves all along.
    trace = [TraceRequest(0.5 * i, 100 if i < 200 else 1000, 5) for i in range(400)]
    merged = merge_streams(trace, 4)
    arrivals = np.array([r.arrival_s for r in merged])
    assert len(merged) == 4 * len(trace)
    assert np.all(np.diff(arrivals) >= 0) and arrivals.max() < 200.0
    assert sorted(r.prompt_tokens for r in merged) == sorted(
        [r.prompt_tokens for r in trace] * 4)
    windows = [np.mean([r.prompt_tokens for r in merged if lo <= r.arrival_s < lo + 20.0])
               for lo in range(0, 200, 20)]
    assert max(windows) - min(windows) < 0.6 * 900, windows  # one copy: 900
    assert merge_streams(trace, 1) == trace
    with pytest.raises(ValueError):
        merge_streams(trace, 0)


def test_diurnal_rate_runs_from_trough_to_peak_and_back():
    rate = diurnal_rate(10.0, 40.0, 1000.0)
    values = rate(np.array([0.0, 250.0, 500.0, 1000.0]))
    assert values.tolist() == pytest.approx([10.0, 25.0, 40.0, 10.0])
    with pytest.raises(ValueError):
        diurnal_rate(50.0, 40.0, 1000.0)
