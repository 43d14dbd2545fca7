"""The simulator's prefix cache: Mooncake-style hash ids become shared tokens, the engine's
block manager finds them, cached prefill is skipped, and prefix-aware routing keeps a
conversation where its prefix is."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.sim.instance import InstanceConfig, RequestRecord
from slipstream.sim.report import prefix_hit_bound_tokens, summarize
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.traces import TraceRequest
from slipstream.sim.workloads import WorkloadSpec, build_workload

MODEL = AnalyticModel(ms_per_token=0.05, ms_per_attended_pair=1e-7, ms_per_decode_kv_token=1e-5,
                      iteration_overhead_ms=0.5)


def config(caching=True, routing="least-load", instances=1, blocks=8192, policy="lars"):
    return SimConfig(scheduler=SchedulerConfig(policy=policy, prefix_caching=caching),
                     instance=InstanceConfig(num_kv_blocks=blocks, link_latency_ms=0.0),
                     num_instances=instances, routing=routing)


def test_hash_ids_become_shared_prompt_tokens():
    a = RequestRecord("a", 0.0, 1100, 1, "t", hash_ids=(5, 6, 7), serial=0)
    b = RequestRecord("b", 0.0, 700, 1, "t", hash_ids=(5, 9), serial=1)
    c = RequestRecord("c", 0.0, 300, 1, "t", serial=2)
    ta, tb, tc = a.prompt_token_ids(), b.prompt_token_ids(), c.prompt_token_ids()
    assert len(ta) == 1100 and len(tb) == 700 and len(tc) == 300
    assert ta[:512] == tb[:512] and ta[512] != tb[512]
    assert set(tc).isdisjoint(ta) and set(tc).isdisjoint(tb)


def test_the_unbounded_bound_counts_leading_blocks_seen_before():
    records = [RequestRecord("a", 0.0, 1500, 1, "t", (1, 2, 3), 0),
               RequestRecord("b", 1.0, 1500, 1, "t", (1, 2, 4), 1),
               RequestRecord("c", 2.0, 1024, 1, "t", (1, 2), 2),
               RequestRecord("d", 3.0, 1500, 1, "t", (9, 2, 3), 3)]
    assert prefix_hit_bound_tokens(records) == [0, 1024, 1023, 0]


def test_cached_prefill_is_skipped_in_the_simulated_time():
    document = tuple(range(16))  # 8192 tokens of shared document
    requests = [TraceRequest(10.0 * i, 8192 + 100, 4, "docs", document + (1000 + i,))
                for i in range(5)]
    results = {}
    for caching in (False, True):
        sim = simulate(requests, config(caching=caching), MODEL)
        results[caching] = summarize(sim, 1 << 20, None)
    cold, warm = results[False], results[True]
    assert cold["prefix_cache"]["hit_rate"] == 0.0
    # Four follow-ups find the 8192-token document cached.
    assert warm["prefix_cache"]["hit_tokens"] == 4 * 8192
    assert warm["prefix_cache"]["fraction_of_bound"] == pytest.approx(1.0)
    assert warm["overall"]["ttft_s"]["p50"] < cold["overall"]["ttft_s"]["p50"] / 5


def test_prefix_routing_beats_least_load_on_hit_rate_with_several_instances():
    requests = build_workload(WorkloadSpec(recipe="multi-turn-docs", qps=2.0, num_requests=240,
                                           seed=3, extra={"documents": 6}))
    assert any(r.hash_ids for r in requests)
    rates = {}
    for routing in ("least-load", "prefix"):
        sim = simulate(requests, config(routing=routing, instances=4, blocks=4096), MODEL)
        summary = summarize(sim, 1 << 20, None)
        assert summary["completed"] == len(requests)
        rates[routing] = summary["prefix_cache"]["hit_rate"]
        bound = summary["prefix_cache"]["bound_hit_rate"]
    assert rates["prefix"] > rates["least-load"]
    assert rates["prefix"] >= 0.8 * bound


def test_the_mooncake_trace_carries_hash_ids():
    requests = build_workload(WorkloadSpec(trace="mooncake", num_requests=50))
    assert all(len(r.hash_ids) == -(-r.prompt_tokens // 512) for r in requests)
    records = [RequestRecord(f"r{i}", r.arrival_s, r.prompt_tokens, r.output_tokens, r.source,
                             r.hash_ids, i) for i, r in enumerate(requests)]
    assert sum(prefix_hit_bound_tokens(records)) > 0
    assert replace(requests[0], hash_ids=()).hash_ids == ()
