"""The discrete-event loop: arrivals, a least-backlog router, and instances stepping on their
own clocks.

    list[TraceRequest] --> route (least backlog, or pools.py by length) --> SimInstance.add()
    event heap: (next step time, instance) --> SimInstance.step() --> next step time
    with rebalanced pools: every period --> PoolRouter.control_step() (may relabel one)
        --> SimResult(records, end time, iterations) --> report.py

Events are only arrivals, iteration boundaries and AWD wakeups, so the cost is one
``schedule()`` per simulated iteration plus a heap operation; nothing is done per token. The
clock jumps over idle gaps. An instance whose scheduler holds short prompts (AWD) sleeps until
its wakeup; an arrival there wakes it at once, and the old wakeup event goes stale. Runs are
deterministic: the only randomness is in the workload, drawn from a seed.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from slipstream.agent.router.config import INSTANCE_QUEUE_ORDERS
from slipstream.agent.router.prefix_affinity import (
    DEFAULT_LOWER_TIER_HIT_WEIGHT, DEFAULT_PREFIX_AFFINITY_WEIGHT, PrefixAffinityIndex)
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE, BlockManager
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import BatchTimeModel
from slipstream.agent.scheduler.scheduler import Scheduler
from slipstream.sim.instance import (
    InstanceConfig, KvpTimeModel, RequestRecord, SimInstance, records_from)
from slipstream.sim.pools import PoolRouter, PoolsConfig
from slipstream.sim.traces import HASH_BLOCK_TOKENS, TraceRequest


ROUTINGS = ("least-load", "prefix")
DECODE_WEIGHT_TOKENS = 32  # the live router's default (RouterConfig.decode_weight_tokens)


@dataclass(frozen=True)
class SimConfig:
    scheduler: SchedulerConfig
    instance: InstanceConfig
    num_instances: int = 1
    num_layers: int = 32  # for KVP merge costs
    horizon_s: float | None = None  # stop the clock here; later work is reported unfinished
    short_ttft_slo_s: float | None = None  # given to short requests; long ones get the default
    long_prompt_tokens: int = 8192  # class boundary for the report and for the SLO above
    progress: bool = False
    pools: PoolsConfig | None = None  # None: one least-backlog router over all instances
    # Without pools: "least-load" (least backlog) or "prefix" (least backlog minus the
    # prefill the instance's cache saves, from an approximate index of what was sent where).
    routing: str = "least-load"
    prefix_affinity_weight: float = DEFAULT_PREFIX_AFFINITY_WEIGHT  # as the live router's
    # With "prefix" routing, how the router assumes instances order queued prefills
    # (RouterConfig.instance_queue_order): "shorter-first" (LARS) counts each queued prefill
    # only up to the new request's uncached prompt, "fifo" counts all of it.
    router_queue_order: str = "shorter-first"

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ValueError("num_instances must be >= 1")
        if self.instance.num_kv_blocks is None:
            raise ValueError("instance.num_kv_blocks must be set (see kv_capacity.py)")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.router_queue_order not in INSTANCE_QUEUE_ORDERS:
            raise ValueError(f"router_queue_order must be one of {INSTANCE_QUEUE_ORDERS}, "
                             f"got {self.router_queue_order!r}")

    @property
    def num_kv_blocks(self) -> int:
        assert self.instance.num_kv_blocks is not None  # checked above
        return self.instance.num_kv_blocks


@dataclass
class SimResult:
    policy: str
    records: list[RequestRecord]
    end_s: float
    num_iterations: int
    wall_s: float
    busy_s: list[float]
    horizon_s: float | None
    pool_moves: list[dict] = field(default_factory=list)
    final_pools: list[str] | None = None
    # Prompt tokens found at first admission, by the tier they came from (all instances).
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)


def make_scheduler(config: SimConfig, model: BatchTimeModel) -> Scheduler:
    instance = config.instance
    scheduler_config = replace(
        config.scheduler, spp_degree=instance.spp,
        kvp_tokens_per_group=instance.kvp_tokens_per_group if instance.kvp > 1 else None)
    if instance.kvp > 1:
        model = KvpTimeModel(model, instance, config.num_layers)
    return Scheduler(scheduler_config,
                     BlockManager(config.num_kv_blocks, 0, BLOCK_SIZE,
                                  prefix_caching=scheduler_config.prefix_caching,
                                  tiers=instance.tier_config()),
                     predictor=model)


def simulate(requests: list[TraceRequest], config: SimConfig, model: BatchTimeModel) -> SimResult:
    started = time.perf_counter()
    records = records_from(requests)
    by_id = {record.request_id: record for record in records}
    instances = [SimInstance(i, make_scheduler(config, model), config.instance, by_id)
                 for i in range(config.num_instances)]
    capacity_tokens = config.num_kv_blocks * BLOCK_SIZE
    events: list[tuple[float, int]] = []
    # The time of each instance's live event in the heap (None: none); other entries are stale.
    scheduled_at: list[float | None] = [None] * len(instances)
    horizon = float("inf") if config.horizon_s is None else config.horizon_s
    now_s, next_arrival, done_reported = 0.0, 0, 0
    progress = tqdm(total=len(records), unit="req", desc=config.scheduler.policy,
                    disable=not config.progress, mininterval=1.0)
    iterations = 0
    router = PoolRouter(config.pools, len(instances)) if config.pools is not None else None
    affinity = None
    # The router scores an instance by the prefix it holds in any tier.
    tier_tokens = (config.instance.kv_host_blocks + config.instance.kv_disk_blocks) * BLOCK_SIZE
    if config.routing == "prefix" and router is None:
        affinity = PrefixAffinityIndex(HASH_BLOCK_TOKENS, capacity_tokens)
    while True:
        arrival_s = records[next_arrival].arrival_s if next_arrival < len(records) else float("inf")
        event_s = events[0][0] if events else float("inf")
        next_s = min(arrival_s, event_s)
        if router is not None and router.next_control_s < next_s < float("inf") \
                and router.next_control_s <= horizon:
            now_s = router.next_control_s
            router.control_step(instances, now_s)
            continue
        if arrival_s <= event_s:
            if arrival_s == float("inf") or arrival_s > horizon:
                break
            now_s = arrival_s
            record = records[next_arrival]
            next_arrival += 1
            if record.prompt_tokens + record.output_tokens + 1 > capacity_tokens:
                continue  # can never fit one instance: reported as unfinished
            if affinity is not None:
                target = _prefix_route(affinity, record, instances, (capacity_tokens, tier_tokens),
                                       config.prefix_affinity_weight,
                                       config.router_queue_order == "shorter-first")
            elif router is None:
                target = min(instances, key=lambda inst: inst.backlog_tokens)
            else:
                target = router.route(record, instances)
            short = record.prompt_tokens < config.long_prompt_tokens
            target.add(record, config.short_ttft_slo_s if short else None)
            wake_at = scheduled_at[target.index]
            if wake_at is None or (target.waiting_for_wakeup and wake_at > now_s):
                heapq.heappush(events, (now_s, target.index))
                scheduled_at[target.index] = now_s
            continue
        if event_s > horizon:
            break
        event_at, index = heapq.heappop(events)
        if scheduled_at[index] != event_at:
            continue  # superseded by an arrival that woke the instance early
        now_s = event_at
        wake_s = instances[index].step(now_s)
        iterations += 1
        scheduled_at[index] = wake_s
        if wake_s is not None:
            heapq.heappush(events, (wake_s, index))
        if config.progress and iterations % 512 == 0:
            finished = sum(inst.num_finished for inst in instances)
            progress.update(finished - done_reported)
            done_reported = finished
    progress.close()
    return SimResult(
        policy=config.scheduler.policy,
        records=records,
        end_s=min(now_s, horizon),
        num_iterations=sum(inst.num_iterations for inst in instances),
        wall_s=time.perf_counter() - started,
        busy_s=[inst.busy_s for inst in instances],
        horizon_s=config.horizon_s,
        pool_moves=router.moves if router is not None else [],
        final_pools=list(router.pools) if router is not None else None,
        tier_hit_tokens=_tier_hits(instances),
    )


def _tier_hits(instances: list[SimInstance]) -> dict[str, int]:
    managers = [inst.scheduler.block_manager for inst in instances]
    host = sum(m.prefix_hit_tokens_host for m in managers)
    disk = sum(m.prefix_hit_tokens_disk for m in managers)
    return {"device": sum(m.prefix_hit_tokens for m in managers) - host - disk,
            "host": host, "disk": disk}


def _prefix_route(affinity: PrefixAffinityIndex, record: RequestRecord,
                  instances: list[SimInstance], capacity_tokens: tuple[int, int],
                  weight: float, shorter_first: bool = True) -> SimInstance:
    """The instance with the least backlog minus the prefill its cache would save; it then
    holds the prompt's blocks. This is the live router's rule (agent/router/dispatcher.py)
    with its load estimate: prefill still to compute plus a fixed weight per decode, each
    prefill counted only up to this request's own uncached prompt when ``shorter_first``."""
    keys: list[int] = []
    parent = 0
    for hash_id in record.hash_ids:  # chained, so a key stands for its whole prefix
        parent = hash((parent, hash_id))
        keys.append(parent)
    most = max(0, record.prompt_tokens - 1)
    cached, value = [], []
    for inst in instances:  # as Dispatcher.cached_tokens and cached_value count them
        device, lower = affinity.cached_split(str(inst.index), keys)
        device = min(device, most)
        lower = min(lower, most - device)
        cached.append(device + lower)
        value.append(device + DEFAULT_LOWER_TIER_HIT_WEIGHT * lower)
    loads = [inst.router_backlog_tokens(
                 DECODE_WEIGHT_TOKENS,
                 max(1, record.prompt_tokens - cached[inst.index]) if shorter_first else None)
             for inst in instances]
    target = min(instances, key=lambda inst: (loads[inst.index] - weight * value[inst.index],
                                              loads[inst.index]))
    affinity.record(str(target.index), keys, *capacity_tokens)
    return target
