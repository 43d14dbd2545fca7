"""AWD short-prefill batching in the simulator: held requests finish, an idle instance sleeps to
its scheduler's wakeup (no 1 ms ticking), and an arrival wakes it early when it fills a group."""

from __future__ import annotations

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.report import summarize
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.traces import TraceRequest, synthesize

MODEL = AnalyticModel(ms_per_token=0.01, ms_per_attended_pair=1e-7,
                      ms_per_decode_kv_token=1e-5, iteration_overhead_ms=0.2)
MS = 0.001


def config(short_prefill_batching: str = "awd", spp: int = 1, **scheduler) -> SimConfig:
    # Buckets 8..64 under a 512-token group budget: AWD's first target depth is 8.
    scheduler_config = SchedulerConfig(
        target_batch_time_ms=20.0, short_prefill_batching=short_prefill_batching,
        awd_max_prompt_tokens=64, awd_token_budget_tokens=512, **scheduler)
    return SimConfig(scheduler=scheduler_config,
                     instance=InstanceConfig(spp=spp, num_kv_blocks=4096, link_latency_ms=0.0,
                                             link_gb_per_s=1e9),
                     long_prompt_tokens=2000)


def test_a_short_only_run_with_awd_finishes_every_request():
    requests = synthesize([(20, 8), (50, 4), (60, 16), (500, 8)], 300, qps=200.0, seed=3)
    for spp in (1, 2):
        result = simulate(requests, config(spp=spp), MODEL)
        summary = summarize(result, 2000, tpot_slo_ms=None)
        assert summary["completed"] == 300 and summary["unfinished"] == 0
        assert all(r.first_token_s >= r.arrival_s for r in result.records)


def test_a_lone_request_waits_out_the_window_exactly():
    requests = [TraceRequest(0.0, 20, 2)]
    # 30.5 ms is not a whole number of 1 ms idle ticks: only a sleep to the wakeup lands on it.
    held = simulate(requests, config(awd_max_wait_ms=30.5), MODEL)
    direct = simulate(requests, config("off"), MODEL)
    delay_s = held.records[0].first_token_s - direct.records[0].first_token_s
    assert abs(delay_s - 30.5 * MS) < 1e-6
    assert held.num_iterations == direct.num_iterations


def test_an_arrival_that_fills_the_group_releases_it_at_once():
    # Eight 20-token prompts one ms apart: the eighth reaches AWD's depth of 8 at 7 ms. The
    # instance is asleep until a later wakeup then, so the arrival itself must wake it.
    requests = [TraceRequest(i * MS, 20, 1) for i in range(8)]
    result = simulate(requests, config(awd_max_wait_ms=50.0), MODEL)
    first_tokens = sorted(r.first_token_s for r in result.records)
    assert first_tokens[0] == first_tokens[-1]  # one prefill batch for all eight
    assert 7 * MS < first_tokens[0] < 10 * MS
    assert result.num_iterations == 1

