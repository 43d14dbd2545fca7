"""The autoscaler loop of one ServingReplica: decide_scale around the agents' load windows, and
scale-down as a drain.

    kopf daemon per ServingReplica --run()--> every spec.autoscaling.periodSeconds:
      pods --observe_pods--> draining instances: nothing in flight (after DRAIN_SETTLE_S) or
        past spec.drainTimeoutSeconds? delete their pods and Service (the agent's own SIGTERM
        drain, agent/server/drain.py, gives stragglers spec.drainTimeoutSeconds more);
        Event InstanceDrained / DrainTimedOut
      other instances: ready ones --agent_client.read_load--> InstanceLoad, the rest Starting
      --decisions.autoscale.decide_scale--> ScaleDecision
        up: status.autoscaling.desiredInstances; reconcile places the new gangs at once
        down: mark the chosen instances draining (the controller pod's role label becomes
          "draining": the client Service and the router select role=controller and drop it),
          then the lower desired count
      Event per decision that changes the count or the outcome; status.autoscaling; gauges

The recommendation history lives in this process only. After an operator restart or a leader
change it starts empty, and decide_scale never scales down before it covers the scale-down
window: a new leader waits rather than guesses. A drain's start is on the pods themselves
(an annotation), so drains survive restarts.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

from slipstream.crds.replica_status import AutoscalingStatus, ServingReplicaStatus
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.decisions.autoscale import AT_MAX, decide_scale
from slipstream.decisions.scale_signals import (InstanceLoad, ScaleDecision, ScaleHistory,
                                                ScaleSignals, Starting)
from slipstream.operator import agent_client, metrics, naming
from slipstream.operator.handle_reconcile import (
    EventSink, mark_draining, now_rfc3339, replica_lock)
from slipstream.operator.handle_rebalance import Stopped, every_period
from slipstream.operator.instances import ObservedInstance, observe_pods
from slipstream.operator.kube import Kube

IDLE_CHECK_S = 10.0  # how often a replica without autoscaling looks again (drains to finish)
# A drained instance reporting nothing in flight is deleted only after this long, so that a
# request the router or a client sent just before the relabel has arrived and is counted.
DRAIN_SETTLE_S = 5.0
LoadReader = Callable[[ObservedInstance], "tuple[InstanceLoad, int] | None"]
Reconcile = Callable[[str, str], object]

_histories: dict[tuple[str, str], ScaleHistory] = {}


def autoscale_step(kube: Kube, namespace: str, name: str, *, event: EventSink,
                   read_load: LoadReader | None = None,
                   clock: Callable[[], float] = time.time,
                   control_token: str | None = None) -> ScaleDecision | None:
    """One step: finish drains, then (with autoscaling on) decide and act. None when the
    replica is gone or does not autoscale. Under the replica lock, like reconcile. The
    agents' control calls carry ``control_token`` (control_credentials.py)."""
    if read_load is None:
        read_load = functools.partial(agent_client.read_load, token=control_token)
    key = (namespace, name)
    with replica_lock(namespace, name):
        body = kube.get_replica(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            _histories.pop(key, None)
            return None
        spec = ServingReplicaSpec.model_validate(body["spec"])
        observed = observe_pods(kube.list_pods(namespace, naming.replica_selector(name)),
                                spec.placement.gpu_resource)
        now = clock()
        finish_drains(kube, body, spec, observed, now, read_load, event)
        if not spec.autoscaled:
            _histories.pop(key, None)
            return None
        previous = ServingReplicaStatus.model_validate(body.get("status") or {})
        signals = scale_signals(observed, previous, read_load, name)
        history = _histories.get(key) or ScaleHistory(since_s=now)
        decision = decide_scale(signals, spec, history, now)
        _histories[key] = decision.history
        for victim in decision.remove:
            if victim in observed:
                mark_draining(kube, namespace, observed[victim], now)
        _export(namespace, name, spec, decision)
        status = with_autoscaling(previous, decision, now_rfc3339())
        old = previous.autoscaling
        if decision.delta or old is None or old.last_scale_reason != decision.reason:
            kind = "Warning" if decision.reason == AT_MAX else "Normal"
            event(body, kind, decision.reason, decision.message)
        if status != previous:
            kube.patch_replica_status(namespace, name,
                                      status.model_dump(mode="json", by_alias=True))
    return decision


def scale_signals(observed: dict[str, ObservedInstance], previous: ServingReplicaStatus,
                  read_load: LoadReader, replica: str) -> ScaleSignals:
    """Ready instances that answer report their load; the rest (starting, failed and being
    recreated, or not answering) count as starting. So do instances desired but not placed
    yet, so that a scale-up waiting for capacity is not asked for again."""
    loads: list[InstanceLoad] = []
    starting: list[Starting] = []
    live = sorted((i for i in observed.values() if not i.draining), key=lambda i: i.index)
    for instance in live:
        reading = read_load(instance) if instance.ready else None
        if reading is None:
            starting.append(Starting(instance.name, instance.pool))
        else:
            loads.append(reading[0])
    desired = previous.autoscaling.desired_instances if previous.autoscaling else 0
    for k in range(max(0, desired - len(live))):
        starting.append(Starting(f"{replica}-unplaced-{k}"))
    return ScaleSignals(loads=tuple(loads), starting=tuple(starting))


def finish_drains(kube: Kube, body: dict, spec: ServingReplicaSpec,
                  observed: dict[str, ObservedInstance], now_s: float, read_load: LoadReader,
                  event: EventSink) -> None:
    """Steps 3 and 4: an instance marked draining is deleted once nothing is in flight, or
    when spec.drainTimeoutSeconds has passed, or at once if its pods failed."""
    timeout_s = spec.drain_timeout_seconds
    namespace = body["metadata"]["namespace"]
    for instance in observed.values():
        since = instance.draining_since_s
        if since is None:
            continue
        if all(pod.deleting for pod in instance.pods):
            # Removed already (by an earlier pass, or by hand): the pods are in the agent's
            # SIGTERM drain. Said once: no second event or count, only the Service made sure of.
            kube.delete("Service", namespace, instance.name)
            continue
        elapsed_s = now_s - since
        reading = read_load(instance) if not instance.failed else None
        in_flight = reading[1] if reading is not None else None
        if instance.failed:
            outcome, message = "finished", "its pods had already stopped"
        elif in_flight == 0 and elapsed_s >= DRAIN_SETTLE_S:
            outcome, message = "finished", f"nothing in flight after {elapsed_s:.0f} s"
        elif elapsed_s >= timeout_s:
            held = "an unknown number of" if in_flight is None else str(in_flight)
            outcome, message = "timed_out", (
                f"spec.drainTimeoutSeconds ({timeout_s}) passed with {held} request(s) in "
                "flight; deleting the pods (the agent's SIGTERM drain gives them as long "
                "again)")
        else:
            continue
        for pod in instance.pods:
            if not pod.deleting:
                kube.delete("Pod", namespace, pod.name)
        kube.delete("Service", namespace, instance.name)
        metrics.DRAINS.labels(outcome).inc()
        reason = "InstanceDrained" if outcome == "finished" else "DrainTimedOut"
        event(body, "Normal" if outcome == "finished" else "Warning", reason,
              f"{instance.name} removed: {message}")


def with_autoscaling(previous: ServingReplicaStatus, decision: ScaleDecision,
                     now: str) -> ServingReplicaStatus:
    """status.autoscaling after a decision. The message and time change with the count or
    the outcome, not with every period's signal values (no status write per period)."""
    old = previous.autoscaling
    changed = decision.delta != 0 or old is None or old.last_scale_reason != decision.reason
    status = AutoscalingStatus(
        desired_instances=decision.desired, current_instances=decision.current,
        last_scale_reason=decision.reason,
        last_scale_message=decision.message if changed or old is None else old.last_scale_message,
        last_scale_time=now if decision.delta else (old.last_scale_time if old else None),
        # Kept until the count changes again: a placement that waits for capacity still
        # finds the pools when it is retried.
        add_pools=list(decision.add_pools) if decision.delta > 0
        else [] if decision.delta < 0 or old is None else old.add_pools)
    return previous.model_copy(update={"autoscaling": status})


def _export(namespace: str, name: str, spec: ServingReplicaSpec, decision: ScaleDecision) -> None:
    replica = metrics.replica_label(namespace, name)
    metrics.DESIRED_INSTANCES.labels(replica).set(decision.desired)
    metrics.CURRENT_INSTANCES.labels(replica).set(decision.current)
    if spec.autoscaling is not None:
        metrics.MAX_INSTANCES.labels(replica).set(spec.autoscaling.max_instances)
    metrics.SCALE_DECISIONS.labels(replica, decision.reason).inc()


def period_s(kube: Kube, namespace: str, name: str) -> float:
    body = kube.get_replica(namespace, name)
    if body is None:
        return IDLE_CHECK_S
    spec = ServingReplicaSpec.model_validate(body["spec"])
    if not spec.autoscaled or spec.autoscaling is None:
        return IDLE_CHECK_S
    return float(spec.autoscaling.period_seconds)


async def run(kube: Kube, namespace: str, name: str, stopped: Stopped, *, event: EventSink,
              reconcile: Reconcile, logger, control_token: str | None = None) -> None:
    """The daemon body: step, sleep a period, until kopf stops it. A scale-up reconciles at
    once, so that the new gangs are placed now rather than at the next resync."""
    async def step() -> None:
        decision = await asyncio.to_thread(autoscale_step, kube, namespace, name, event=event,
                                           control_token=control_token)
        if decision is None:
            return
        if decision.delta > 0:
            await asyncio.to_thread(reconcile, namespace, name)
        logger.debug(f"autoscale: {decision.reason}: {decision.message}")

    await every_period(stopped, lambda: period_s(kube, namespace, name), step, "autoscale",
                       logger)
