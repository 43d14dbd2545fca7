"""Length-aware pools in the simulator: length routing, and the operator's rebalancer moving
an instance under short-pool pressure no more often than its cooldown allows."""

from __future__ import annotations

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.pools import PoolsConfig
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.traces import TraceRequest
from slipstream.crds.servingreplica import Rebalance

MODEL = AnalyticModel(ms_per_token=0.01, ms_per_attended_pair=1e-7,
                      ms_per_decode_kv_token=1e-5, iteration_overhead_ms=0.2)


def config(pools: PoolsConfig | None, num_instances: int = 4) -> SimConfig:
    return SimConfig(scheduler=SchedulerConfig(policy="fcfs", target_batch_time_ms=20.0,
                                               max_space_share_fraction=0.0),
                     instance=InstanceConfig(num_kv_blocks=8192), num_instances=num_instances,
                     long_prompt_tokens=2000, pools=pools)


def test_requests_go_to_their_length_pool():
    requests = [TraceRequest(0.01 * i, 5000 if i % 4 == 0 else 200, 4) for i in range(200)]
    pools = PoolsConfig(mode="static", short_instances=3, long_threshold_tokens=2000)
    result = simulate(requests, config(pools), MODEL)
    assert all(r.finished_s is not None for r in result.records)
    long_instances = {r.instance for r in result.records if r.prompt_tokens >= 2000}
    short_instances = {r.instance for r in result.records if r.prompt_tokens < 2000}
    assert long_instances == {3}
    assert short_instances == {0, 1, 2}  # least backlog spreads them inside the pool
    assert result.pool_moves == [] and result.final_pools == ["short"] * 3 + ["long"]


def test_short_pressure_moves_long_instances_respecting_cooldown():
    # Only short requests, far more than one instance can prefill: the short pool's backlog
    # grows while the long pool idles, so the rebalancer takes long instances one at a time.
    requests = [TraceRequest(0.002 * i, 1500, 2) for i in range(30_000)]
    rebalance = Rebalance(period_seconds=5, cooldown_seconds=20, hysteresis=0.2, min_per_pool=1)
    pools = PoolsConfig(mode="rebalanced", short_instances=1, long_threshold_tokens=2000,
                        rebalance=rebalance)
    result = simulate(requests, config(pools), MODEL)
    moves = result.pool_moves
    assert [(m["from"], m["to"]) for m in moves] == [("long", "short")] * 2
    assert moves[0]["pressure_short"] > moves[0]["pressure_long"]
    gaps = [b["time_s"] - a["time_s"] for a, b in zip(moves, moves[1:])]
    assert all(gap >= 20 for gap in gaps)
    assert result.final_pools.count("long") == 1  # min_per_pool keeps the last long instance
    # Later short requests spread over the instances that moved.
    late = {r.instance for r in result.records if r.arrival_s > moves[-1]["time_s"]}
    assert len(late) == 3


def test_static_pools_never_move():
    requests = [TraceRequest(0.002 * i, 1500, 2) for i in range(5_000)]
    pools = PoolsConfig(mode="static", short_instances=1, long_threshold_tokens=2000,
                        rebalance=Rebalance(period_seconds=1, cooldown_seconds=1))
    result = simulate(requests, config(pools), MODEL)
    assert result.pool_moves == []
    assert {r.instance for r in result.records} == {0}
