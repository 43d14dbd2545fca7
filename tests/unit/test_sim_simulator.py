"""The simulator drives the real scheduler: completion, horizons, SPP, KVP, determinism."""

from __future__ import annotations

import pytest

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.sim.instance import InstanceConfig, KvpTimeModel
from slipstream.sim.report import summarize, ttft_s
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.traces import TraceRequest, synthesize

# 0.01 ms per token and a little attention: a 512-token chunk takes about 5 ms.
MODEL = AnalyticModel(ms_per_token=0.01, ms_per_attended_pair=1e-7,
                      ms_per_decode_kv_token=1e-5, iteration_overhead_ms=0.2)
LENGTHS = [(64, 8), (300, 20), (1500, 40), (4000, 5)]


def config(policy: str = "lars", spp: int = 1, horizon_s: float | None = None,
           num_instances: int = 1, **instance) -> SimConfig:
    return SimConfig(scheduler=SchedulerConfig(policy=policy, target_batch_time_ms=20.0),
                     instance=InstanceConfig(spp=spp, num_kv_blocks=4096, link_latency_ms=0.0,
                                             link_gb_per_s=1e9, **instance),
                     num_instances=num_instances, horizon_s=horizon_s, long_prompt_tokens=2000)


@pytest.mark.parametrize("policy", ["fcfs", "edf", "lrs", "lars", "lars-classic", "srpt", "justitia"])
def test_light_load_finishes_every_request(policy):
    requests = synthesize(LENGTHS, 200, qps=5.0, seed=1)
    result = simulate(requests, config(policy), MODEL)
    assert all(r.finished_s is not None for r in result.records)
    assert all(r.first_token_s >= r.arrival_s for r in result.records)
    summary = summarize(result, 2000, tpot_slo_ms=None)
    assert summary["completed"] == 200 and summary["unfinished"] == 0
    # Under light load nobody waits long: TTFT is close to the request's own prefill time.
    assert summary["overall"]["ttft_s"]["p99"] < 0.2


def test_overload_past_the_horizon_reports_unfinished():
    requests = synthesize([(4000, 200)], 400, qps=200.0, seed=2)
    result = simulate(requests, config("fcfs", horizon_s=1.0), MODEL)
    summary = summarize(result, 2000, None)
    assert summary["unfinished"] > 0
    assert summary["completed"] + summary["unfinished"] == 400
    assert summary["duration_s"] == pytest.approx(1.0)
    assert summary["worst_long_delay_s"] > 0.5  # a long request waited up to the horizon


def one_prefill_ttft(spp: int) -> float:
    result = simulate([TraceRequest(0.0, 60_000, 1)], config("fcfs", spp=spp), MODEL)
    return ttft_s(result.records[0])


def test_spp_halves_prefill_time():
    one_stage, two_stages = one_prefill_ttft(1), one_prefill_ttft(2)
    # The last chunk still crosses both stages, so slightly more than half.
    assert 0.5 * one_stage <= two_stages <= 0.55 * one_stage


def test_spp_keeps_decode_latency():
    single = simulate([TraceRequest(0.0, 32, 200)], config("fcfs", spp=1), MODEL).records[0]
    piped = simulate([TraceRequest(0.0, 32, 200)], config("fcfs", spp=2), MODEL).records[0]
    # A decode waits for its own token, which leaves the pipeline after both stages.
    decode_time = lambda r: (r.finished_s - r.first_token_s) / (r.output_tokens - 1)  # noqa: E731
    assert decode_time(piped) == pytest.approx(decode_time(single), rel=0.01)


def test_kvp_splits_long_attention_and_adds_merge_cost():
    instance = InstanceConfig(tp=8, kvp=4, kvp_tokens_per_group=100_000, link_latency_ms=0.01)
    kvp_model = KvpTimeModel(MODEL, instance, num_layers=32)
    alone = MODEL.prefill_attention_ms(350_000, 512)
    split = kvp_model.prefill_attention_ms(350_000, 512)
    assert split < alone / 2  # the largest shard holds 100K of the 350K tokens
    assert split > MODEL.prefill_attention_ms(100_000, 512)  # the merge is not free
    # Inside the first group nothing changes.
    assert kvp_model.prefill_attention_ms(50_000, 512) == MODEL.prefill_attention_ms(50_000, 512)


def test_simulation_is_deterministic_by_seed():
    def run(seed: int) -> list[tuple]:
        requests = synthesize(LENGTHS, 150, qps=40.0, seed=seed)
        result = simulate(requests, config("lars", num_instances=2), MODEL)
        return [(r.instance, r.first_token_s, r.finished_s) for r in result.records]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_router_spreads_load_over_instances():
    requests = synthesize(LENGTHS, 300, qps=100.0, seed=4)
    result = simulate(requests, config("fcfs", num_instances=3), MODEL)
    per_instance = [sum(r.instance == i for r in result.records) for i in range(3)]
    assert min(per_instance) > 50
    assert all(r.finished_s is not None for r in result.records)
