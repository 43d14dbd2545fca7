"""Disaggregated deployments in the simulator: prefill instances, a KV link, decode instances.

    arrival --route (least backlog, or PLA-Serve pools by length)--> prefill SimInstance
        the real scheduler prefills it and samples its first token (max_tokens = 1)
    --> KV transfer on the prefill instance's link, FIFO:
        bytes = prompt tokens x KV bytes per token; time = latency + bytes / bandwidth,
        the instance's ``tp`` GPUs each sending their shard over their own NIC
    --> decode instance with the least KV held (the router's rule)
        Scheduler.add_running(): the request joins the running decodes with its first token
        (the client sees that token now: TTFT includes the transfer), or waits for blocks
    --> decodes batched under the same scheduler and time model --> finished

Both sides run the same ``Scheduler`` and runtime predictor as the mixed simulator, so the
comparison with ``simulator.simulate`` at equal GPU count isolates the design. The prefill
instance frees its blocks when the first token is sampled; the transfer's hold on them (a
few milliseconds at the bandwidths studied) is not modelled.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from slipstream.contracts.request import EngineRequest, RequestSLO
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE, blocks_for_tokens
from slipstream.agent.scheduler.predictor import BatchTimeModel
from slipstream.agent.scheduler.request import Request
from slipstream.sim.instance import RequestRecord, SimInstance, records_from
from slipstream.sim.pools import PoolRouter
from slipstream.sim.simulator import SimConfig, SimResult, make_scheduler
from slipstream.sim.traces import TraceRequest

# Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes (bf16).
LLAMA3_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


@dataclass(frozen=True)
class DisaggConfig:
    prefill_instances: int
    decode_instances: int
    link_gbit_per_s: float = 100.0  # per GPU NIC (25, 100, 400 Gb/s in the study)
    link_latency_ms: float = 0.05
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if self.prefill_instances < 1 or self.decode_instances < 1:
            raise ValueError("a disaggregated deployment needs >= 1 prefill and >= 1 decode "
                             "instance")
        if self.link_gbit_per_s <= 0 or self.link_latency_ms < 0:
            raise ValueError("link bandwidth must be > 0 and latency >= 0")

    def transfer_s(self, prompt_tokens: int, tp: int) -> float:
        bytes_per_gpu = prompt_tokens * self.kv_bytes_per_token / tp
        return self.link_latency_ms / 1000.0 + bytes_per_gpu * 8 / (self.link_gbit_per_s * 1e9)


class DecodeSimInstance(SimInstance):
    """A decode instance: requests arrive with their KV and first token."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.waiting_kv: list[RequestRecord] = []  # arrived, no blocks free yet
        self.kv_tokens = 0  # KV held or on its way here (the router's score)
        self._holding: list[RequestRecord] = []

    def promise(self, record: RequestRecord) -> None:
        """The router picked this instance; the KV is on the link."""
        self.kv_tokens += record.prompt_tokens + record.output_tokens
        self._holding.append(record)

    def admit(self, record: RequestRecord, now_s: float) -> None:
        self.waiting_kv.append(record)
        self.admit_waiting(now_s)

    def admit_waiting(self, now_s: float) -> None:
        manager = self.scheduler.block_manager
        while self.waiting_kv:
            record = self.waiting_kv[0]
            needed = blocks_for_tokens(record.prompt_tokens, BLOCK_SIZE)
            # Keep one block per running request for its next decode, as swap-in does.
            if needed + len(self.scheduler.running) > manager.kv_blocks_free:
                return
            self.waiting_kv.pop(0)
            request = Request(EngineRequest(
                record.request_id, [0] * record.prompt_tokens,
                SamplingParams(max_tokens=record.output_tokens),
                slo=RequestSLO(ttft_s=record.ttft_deadline_s)), record.arrival_s)
            request.output_token_ids.append(0)
            request.num_computed_tokens = record.prompt_tokens
            request.block_ids = manager.device.allocate(needed)
            self.scheduler.add_running(request, now_s)
            record.instance = self.index
            record.first_token_s = now_s  # the client's first token: after the transfer

    def step(self, now_s: float) -> float | None:
        self.admit_waiting(now_s)
        before = self.num_finished
        wake = super().step(now_s)
        if self.num_finished != before:
            done = [r for r in self._holding if r.finished_s is not None]
            self._holding = [r for r in self._holding if r.finished_s is None]
            self.kv_tokens -= sum(r.prompt_tokens + r.output_tokens for r in done)
            self.admit_waiting(now_s)
            if wake is None and self.waiting_kv:
                wake = now_s  # blocks came free: admit on the next step
        return wake


def simulate_disagg(requests: list[TraceRequest], config: SimConfig, disagg: DisaggConfig,
                    model: BatchTimeModel) -> SimResult:
    """Like ``simulate``, on ``disagg.prefill_instances + disagg.decode_instances`` instances
    of ``config.instance``; ``config.pools`` splits the prefill instances into pools."""
    started = time.perf_counter()
    records = records_from(requests)
    by_id = {record.request_id: record for record in records}
    # Prefill instances see shadow records (one output token); the real record follows the
    # request to its decode instance.
    shadows: dict[str, RequestRecord] = {}
    num_prefill = disagg.prefill_instances
    prefills = [SimInstance(i, make_scheduler(config, model), config.instance, shadows)
                for i in range(num_prefill)]
    decodes = [DecodeSimInstance(num_prefill + j, make_scheduler(config, model),
                                 config.instance, by_id)
               for j in range(disagg.decode_instances)]
    instances: list[SimInstance] = [*prefills, *decodes]
    capacity_tokens = config.num_kv_blocks * BLOCK_SIZE
    tp = config.instance.tp
    link_free_s = [0.0] * num_prefill
    in_prefill: list[set[str]] = [set() for _ in prefills]
    # Events: (time, order, kind, payload). kind 0: an instance steps (payload: index);
    # kind 1: a KV transfer lands (payload: (record id, decode position)).
    events: list[tuple[float, int, int, object]] = []
    order = 0
    scheduled_at: list[float | None] = [None] * len(instances)
    horizon = float("inf") if config.horizon_s is None else config.horizon_s
    router = PoolRouter(config.pools, num_prefill) if config.pools is not None else None
    now_s, next_arrival = 0.0, 0

    def wake(index: int, at_s: float) -> None:
        nonlocal order
        current = scheduled_at[index]
        instance = instances[index]
        if current is None or (instance.waiting_for_wakeup and current > at_s):
            order += 1
            heapq.heappush(events, (at_s, order, 0, index))
            scheduled_at[index] = at_s

    while True:
        arrival_s = records[next_arrival].arrival_s if next_arrival < len(records) else float("inf")
        event_s = events[0][0] if events else float("inf")
        next_s = min(arrival_s, event_s)
        if router is not None and router.next_control_s < next_s < float("inf") \
                and router.next_control_s <= horizon:
            now_s = router.next_control_s
            router.control_step(prefills, now_s)
            continue
        if arrival_s <= event_s:
            if arrival_s == float("inf") or arrival_s > horizon:
                break
            now_s = arrival_s
            record = records[next_arrival]
            next_arrival += 1
            if record.prompt_tokens + record.output_tokens + 1 > capacity_tokens:
                continue  # can never fit one instance: reported as unfinished
            shadow = RequestRecord(record.request_id, record.arrival_s, record.prompt_tokens,
                                   1, record.source, record.hash_ids, serial=record.serial)
            shadows[record.request_id] = shadow
            target = min(prefills, key=lambda inst: inst.backlog_tokens) if router is None \
                else router.route(shadow, prefills)
            short = record.prompt_tokens < config.long_prompt_tokens
            target.add(shadow, config.short_ttft_slo_s if short else None)
            record.ttft_deadline_s = shadow.ttft_deadline_s
            in_prefill[target.index].add(record.request_id)
            wake(target.index, now_s)
            continue
        if event_s > horizon:
            break
        event_at, _, kind, payload = heapq.heappop(events)
        now_s = event_at
        if kind == 1:
            assert isinstance(payload, tuple)
            landed_id, landed_at = payload
            decode = decodes[landed_at]
            decode.admit(by_id[landed_id], now_s)
            wake(decode.index, now_s)
            continue
        assert isinstance(payload, int)
        index = payload
        if scheduled_at[index] != event_at:
            continue  # superseded by an earlier wakeup
        instance = instances[index]
        wake_s = instance.step(now_s)
        scheduled_at[index] = wake_s
        if wake_s is not None:
            order += 1
            heapq.heappush(events, (wake_s, order, 0, index))
        if index < num_prefill:
            done = [rid for rid in in_prefill[index] if shadows[rid].finished_s is not None]
            for request_id in done:
                in_prefill[index].discard(request_id)
                shadow = shadows.pop(request_id)
                record = by_id[request_id]
                record.num_preemptions = shadow.num_preemptions
                assert shadow.finished_s is not None
                if record.output_tokens <= 1:  # the first token was the whole answer
                    record.first_token_s = record.finished_s = shadow.finished_s
                    continue
                position = min(range(len(decodes)), key=lambda j: decodes[j].kv_tokens)
                decodes[position].promise(record)
                begin_s = max(shadow.finished_s, link_free_s[index])
                land_s = begin_s + disagg.transfer_s(record.prompt_tokens, tp)
                link_free_s[index] = land_s
                order += 1
                heapq.heappush(events, (land_s, order, 1, (request_id, position)))
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
    )


def equal_gpu_split(num_instances: int, ratio: tuple[int, int]) -> tuple[int, int]:
    """Prefill and decode instance counts for ``ratio`` (prefill:decode) out of
    ``num_instances``, each side at least one."""
    prefill = round(num_instances * ratio[0] / (ratio[0] + ratio[1]))
    prefill = min(num_instances - 1, max(1, prefill))
    return prefill, num_instances - prefill

