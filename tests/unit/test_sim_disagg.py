"""The disaggregated simulator: every request is prefilled on a prefill instance, its KV
crosses the link (TTFT includes the transfer), and it is decoded on a decode instance by the
real scheduler; decodes there are never slowed by prefill chunks."""

from __future__ import annotations

import pytest

from slipstream.sim.disagg import DisaggConfig, equal_gpu_split, simulate_disagg
from slipstream.sim.pools import PoolsConfig
from slipstream.sim.report import summarize, tpot_s, ttft_s
from slipstream.sim.simulator import simulate
from slipstream.sim.traces import synthesize

from tests.unit.test_sim_simulator import LENGTHS, MODEL, config


def test_every_request_is_prefilled_moved_and_decoded():
    requests = synthesize(LENGTHS, 150, qps=5.0, seed=3)
    disagg = DisaggConfig(1, 2, link_gbit_per_s=10.0, kv_bytes_per_token=100_000)
    result = simulate_disagg(requests, config(), disagg, MODEL)
    summary = summarize(result, 2000, tpot_slo_ms=None)
    assert summary["completed"] == 150 and summary["unfinished"] == 0
    for record in result.records:
        assert record.finished_s is not None and record.first_token_s is not None
        if record.output_tokens > 1:
            assert record.instance in (1, 2)  # decoded on a decode instance
            # The first token reaches the client only after its KV crossed the link.
            assert ttft_s(record) >= disagg.transfer_s(record.prompt_tokens, 1) - 1e-9
    assert {r.instance for r in result.records if r.output_tokens > 1} == {1, 2}


def test_a_slower_link_costs_ttft_and_nothing_else():
    requests = synthesize(LENGTHS, 100, qps=2.0, seed=4)
    fast, slow = (simulate_disagg(requests, config(), DisaggConfig(
        1, 1, link_gbit_per_s=gbit, kv_bytes_per_token=100_000), MODEL) for gbit in (1e4, 1.0))
    fast_ttft = sum(ttft_s(r) for r in fast.records)
    slow_ttft = sum(ttft_s(r) for r in slow.records)
    assert slow_ttft > fast_ttft + 0.5 * sum(r.prompt_tokens * 0.8e-3 for r in requests)


def test_decodes_do_not_share_batches_with_prefills():
    """A steady decode stream next to long prompts: mixed instances interleave prefill chunks
    with the decodes (TPOT up to a full batch budget), decode instances never do."""
    requests = synthesize([(3000, 60), (50, 60)], 120, qps=20.0, seed=5)
    mixed = simulate(requests, config(num_instances=2), MODEL)
    split = simulate_disagg(requests, config(), DisaggConfig(1, 1, link_gbit_per_s=1e4), MODEL)

    def worst_tpot(result) -> float:
        return max(t for r in result.records if (t := tpot_s(r)) is not None)

    assert worst_tpot(split) < worst_tpot(mixed)


def test_prefill_pools_route_by_length():
    requests = synthesize(LENGTHS, 80, qps=4.0, seed=6)
    cfg = config()
    cfg = type(cfg)(**{**cfg.__dict__, "pools": PoolsConfig(
        mode="static", short_instances=1, long_threshold_tokens=2000)})
    result = simulate_disagg(requests, cfg, DisaggConfig(2, 2), MODEL)
    assert summarize(result, 2000, None)["unfinished"] == 0


@pytest.mark.parametrize(("instances", "ratio", "expected"),
                         [(4, (1, 1), (2, 2)), (4, (1, 3), (1, 3)), (2, (1, 3), (1, 1)),
                          (8, (1, 3), (2, 6))])
def test_equal_gpu_split(instances, ratio, expected):
    assert equal_gpu_split(instances, ratio) == expected


def test_distinct_prompts_are_not_found_in_the_prefix_cache():
    """Well-spaced prompts that share nothing: each is prefilled in full on the prefill
    instance, so its TTFT is at least the mixed instance's (which also prefills it whole)
    plus the transfer. With one stand-in token stream for every prompt, the prefill side
    found them all cached and answered ~50x faster."""
    requests = synthesize([(3000, 4)], 20, qps=0.2, seed=7)
    split = simulate_disagg(requests, config(), DisaggConfig(1, 1, link_gbit_per_s=1e4), MODEL)
    mixed = simulate(requests, config(num_instances=1), MODEL)
    mixed_ttft = {r.arrival_s: ttft_s(r) for r in mixed.records}
    for record in split.records:
        assert ttft_s(record) >= mixed_ttft[record.arrival_s] - 1e-9
