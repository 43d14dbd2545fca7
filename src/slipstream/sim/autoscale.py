"""A fleet of instances whose count the operator's autoscaler drives, on the simulated clock.

    arrival --least backlog over the serving instances--> SimInstance.add()
    every spec.autoscaling.periodSeconds: SimInstance load windows --> InstanceLoad
        --decisions.autoscale.decide_scale()--> ScaleDecision
        up: new instances, serving ``startup_s`` after the decision (pod start, model load)
        down: the chosen instance drains: no new requests, gone once its requests finish
    --> FleetResult: request records, the timeline, instance-seconds

The decision is the operator's own ``decide_scale``, not a copy, and its signals are built as
the agent builds them (``LoadWindow``, queue backlog priced at the recent prefill rate, KV
blocks in use). A static fleet is the same loop with no autoscaler, so the comparison differs
only in the count. An instance costs from the decision that starts it (GPUs are held while
it loads) to the moment its drain ends.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from slipstream.agent.engine.step.load_window import LoadWindow
from slipstream.agent.engine.step.stats import NOMINAL_PREFILL_TOKENS_PER_S
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.agent.scheduler.predictor import BatchTimeModel
from slipstream.sim.instance import RequestRecord, SimInstance, records_from
from slipstream.sim.simulator import SimConfig, make_scheduler
from slipstream.sim.traces import TraceRequest
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.decisions.autoscale import decide_scale
from slipstream.decisions.scale_signals import (InstanceLoad, ScaleDecision, ScaleHistory,
                                                ScaleSignals, Starting)

DEFAULT_STARTUP_S = 120.0  # decision to serving: pod scheduled, image present, 8B weights loaded
TIMELINE_STEP_S = 30.0  # how often a static fleet samples its timeline


@dataclass
class Member:
    sim: SimInstance
    started_s: float
    serving_s: float  # when it takes requests (started_s + startup)
    draining_s: float | None = None
    stopped_s: float | None = None

    @property
    def name(self) -> str:
        return f"i{self.sim.index}"

    def serving(self, now_s: float) -> bool:
        return self.serving_s <= now_s and self.draining_s is None


@dataclass
class FleetResult:
    records: list[RequestRecord]
    end_s: float
    wall_s: float
    instance_seconds: float
    timeline: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)  # the ones that changed the count


def instance_load(member: Member, now_s: float) -> InstanceLoad:
    sim = member.sim
    snapshot = sim.load.snapshot(now_s)
    rate = snapshot.prefill_tokens_per_s or NOMINAL_PREFILL_TOKENS_PER_S
    blocks = sim.scheduler.block_manager
    return InstanceLoad(
        instance=member.name, first_tokens=snapshot.first_tokens, ttft_met=snapshot.ttft_met,
        finished=snapshot.finished, tpot_met=snapshot.tpot_met,
        queue_delay_s=sim.backlog_prompt_tokens() / rate,
        kv_utilization=blocks.kv_blocks_used / max(1, blocks.kv_blocks_total),
        busy_fraction=snapshot.utilization,
        prefill_load=snapshot.arrival_prompt_tokens_per_s / rate,
        slo_deviation=snapshot.slo_deviation)


class Fleet:
    """The instances, their events, and (with a spec) the autoscaler's loop."""

    def __init__(self, requests: list[TraceRequest], config: SimConfig, model: BatchTimeModel,
                 *, instances: int, spec: ServingReplicaSpec | None, startup_s: float,
                 tpot_slo_s: float | None) -> None:
        self.config, self.model, self.spec = config, model, spec
        self.startup_s, self.tpot_slo_s = startup_s, tpot_slo_s
        self.records = records_from(requests)
        self.by_id = {record.request_id: record for record in self.records}
        self.members: list[Member] = []
        self.events: list[tuple[float, int]] = []
        self.scheduled_at: list[float | None] = []
        for _ in range(instances):
            self._start(0.0, serving_s=0.0)
        self.history = ScaleHistory(since_s=0.0)
        self.decisions: list[dict] = []
        self.timeline: list[dict] = []
        self.arrived_since_sample = 0

    def _start(self, now_s: float, serving_s: float) -> Member:
        index = len(self.members)
        sim = SimInstance(index, make_scheduler(self.config, self.model), self.config.instance,
                          self.by_id, tpot_slo_s=self.tpot_slo_s)
        # The agent's load window starts with its engine, when the instance starts serving
        # (not at the decision: the minute of startup has no arrivals to average in).
        sim.load = LoadWindow(start_s=serving_s)
        member = Member(sim, started_s=now_s, serving_s=serving_s)
        self.members.append(member)
        self.scheduled_at.append(None)
        return member

    def _wake(self, index: int, now_s: float) -> None:
        wake_at = self.scheduled_at[index]
        if wake_at is None or (self.members[index].sim.waiting_for_wakeup and wake_at > now_s):
            heapq.heappush(self.events, (now_s, index))
            self.scheduled_at[index] = now_s

    def route(self, record: RequestRecord, now_s: float) -> None:
        serving = [m for m in self.members if m.serving(now_s)]
        target = min(serving, key=lambda m: m.sim.backlog_tokens)
        short = record.prompt_tokens < self.config.long_prompt_tokens
        target.sim.add(record, self.config.short_ttft_slo_s if short else None)
        self._wake(target.sim.index, now_s)

    def step(self) -> float:
        event_at, index = heapq.heappop(self.events)
        if self.scheduled_at[index] != event_at:
            return event_at  # superseded by an arrival that woke the instance early
        member = self.members[index]
        wake_s = member.sim.step(event_at)
        self.scheduled_at[index] = wake_s
        if wake_s is not None:
            heapq.heappush(self.events, (wake_s, index))
        elif member.draining_s is not None and member.stopped_s is None and member.sim.idle:
            member.stopped_s = event_at
        return event_at

    def control(self, now_s: float) -> ScaleDecision:
        assert self.spec is not None
        live = [m for m in self.members if m.draining_s is None]
        signals = ScaleSignals(
            loads=tuple(instance_load(m, now_s) for m in live if m.serving_s <= now_s),
            starting=tuple(Starting(m.name) for m in live if m.serving_s > now_s))
        decision = decide_scale(signals, self.spec, self.history, now_s)
        self.history = decision.history
        for _ in decision.add_pools:
            self._start(now_s, serving_s=now_s + self.startup_s)
        for name in decision.remove:
            member = next(m for m in live if m.name == name)
            member.draining_s = now_s
            if member.sim.idle:
                member.stopped_s = now_s
        if decision.delta:
            self.decisions.append({"time_s": now_s, "from": decision.current,
                                   "to": decision.desired, "reason": decision.reason,
                                   "message": decision.message})
        return decision

    def sample(self, now_s: float, period_s: float, desired: int | None) -> None:
        self.timeline.append({
            "time_s": now_s, "arrival_qps": self.arrived_since_sample / period_s,
            "instances": sum(1 for m in self.members if m.stopped_s is None),
            "serving": sum(1 for m in self.members if m.serving(now_s)),
            "desired": desired})
        self.arrived_since_sample = 0

    def instance_seconds(self, end_s: float, start_s: float = 0.0) -> float:
        return sum(max(0.0, min(end_s, m.stopped_s if m.stopped_s is not None else end_s)
                       - max(start_s, m.started_s)) for m in self.members)


def simulate_fleet(requests: list[TraceRequest], config: SimConfig, model: BatchTimeModel, *,
                   instances: int, spec: ServingReplicaSpec | None = None,
                   startup_s: float = DEFAULT_STARTUP_S, tpot_slo_s: float | None = None,
                   bill_from_s: float = 0.0, bill_until_s: float | None = None) -> FleetResult:
    """``instances`` to start with (all serving at t = 0); with ``spec.autoscaling`` the
    autoscaler takes it from there, without it the count stays. Runs to ``config.horizon_s``
    (required); instance-seconds are counted from ``bill_from_s`` (a warm-up before it, so
    that the autoscaler starts the measured part with a history, as a running operator has
    one) up to ``bill_until_s`` (default: the horizon), so that a tail after the last
    arrival lets requests finish without being billed."""
    if config.horizon_s is None:
        raise ValueError("simulate_fleet needs config.horizon_s")
    if spec is not None and not spec.autoscaled:
        raise ValueError("spec must enable autoscaling (or pass none for a static fleet)")
    started = time.perf_counter()
    fleet = Fleet(requests, config, model, instances=instances, spec=spec, startup_s=startup_s,
                  tpot_slo_s=tpot_slo_s)
    capacity_tokens = config.num_kv_blocks * BLOCK_SIZE
    records, horizon = fleet.records, config.horizon_s
    period_s = float(spec.autoscaling.period_seconds) if spec and spec.autoscaling \
        else TIMELINE_STEP_S
    next_control_s, next_arrival, now_s = period_s, 0, 0.0
    while True:
        arrival_s = records[next_arrival].arrival_s if next_arrival < len(records) else math.inf
        event_s = fleet.events[0][0] if fleet.events else math.inf
        if next_control_s <= min(arrival_s, event_s) and next_control_s <= horizon:
            now_s = next_control_s
            desired = fleet.control(now_s).desired if spec is not None else None
            fleet.sample(now_s, period_s, desired)
            next_control_s += period_s
            continue
        if min(arrival_s, event_s) > horizon:
            break
        if arrival_s <= event_s:
            now_s = arrival_s
            record = records[next_arrival]
            next_arrival += 1
            fleet.arrived_since_sample += 1
            if record.prompt_tokens + record.output_tokens + 1 <= capacity_tokens:
                fleet.route(record, now_s)
            continue
        now_s = fleet.step()
    return FleetResult(records=records, end_s=horizon, wall_s=time.perf_counter() - started,
                       instance_seconds=fleet.instance_seconds(
                           horizon if bill_until_s is None else bill_until_s, bill_from_s),
                       timeline=fleet.timeline, decisions=fleet.decisions)
