"""The pool rebalancer loop of one ServingReplica (PLA-Serve Algorithm 2 around
decisions/pools.py).

    kopf daemon per ServingReplica --run()--> every spec.pools.rebalance.periodSeconds:
      pods --observe_pods--> ready instances --agent_client.read_signals--> InstanceSignals
      --rebalancer.decide--> move? relabel the instance's pods (pool Services follow), SetPool,
      Event "PoolRebalanced"; status: pools, pressures, PoolsBalanced, lastRebalanceTime

The time of the last move lives in the status (``pools.lastRebalanceTime``), so the cooldown
holds across operator restarts and leader changes.

With spec.autoscaling the autoscaler goes first (docs/autoscaling.md): while it changes the
count (instances draining, or desired != current) the rebalancer waits, and a scale event
restarts its cooldown as a move would, so it judges the split on signals of the new count.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from slipstream.crds.replica_status import ServingReplicaStatus
from slipstream.crds.servingreplica import POOL_NAMES, ServingReplicaSpec
from slipstream.operator import agent_client, metrics, naming
from slipstream.operator.handle_reconcile import EventSink, now_rfc3339, replica_lock
from slipstream.operator.instances import ObservedInstance, observe_pods
from slipstream.operator.kube import Kube
from slipstream.decisions.pools import (
    COOLING_DOWN, InstanceSignals, Move, RebalanceDecision, decide)
from slipstream.operator.status import with_rebalance

IDLE_CHECK_S = 30.0  # how often a replica without (enabled) pools looks again
SignalReader = Callable[[ObservedInstance], InstanceSignals | None]


class Stopped(Protocol):
    """kopf's DaemonStopped: true once the daemon should stop; ``wait`` sleeps until then."""

    def wait(self, timeout: float | None = None) -> Awaitable[object]: ...

    def __bool__(self) -> bool: ...


async def every_period(stopped: Stopped, period_s: Callable[[], float],
                       step: Callable[[], Awaitable[None]], what: str, logger) -> None:
    """A daemon's loop: wait ``period_s()`` (read each time, off the event loop), run
    ``step``, until kopf stops the daemon. A failed step is logged and the loop goes on."""
    while not stopped:
        await stopped.wait(await asyncio.to_thread(period_s))
        if stopped:
            break
        try:
            await step()
        except Exception as error:  # noqa: BLE001 - a failed step must not end the loop
            logger.warning(f"{what} step failed: {error!r}")


def parse_time_s(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def rebalance_step(kube: Kube, namespace: str, name: str, *, event: EventSink,
                   read_signals: SignalReader | None = None,
                   clock: Callable[[], float] = time.time,
                   control_token: str | None = None) -> RebalanceDecision | None:
    """One control step; None when the replica is gone or does not rebalance. Like
    reconcile, it reads the replica under the lock, so the two never undo each other. The
    agents' control calls carry ``control_token`` (control_credentials.py)."""
    if read_signals is None:
        read_signals = functools.partial(agent_client.read_signals, token=control_token)
    with replica_lock(namespace, name):
        body = kube.get_replica(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        spec = ServingReplicaSpec.model_validate(body["spec"])
        if spec.pools is None or not spec.pools.rebalance.enabled:
            return None
        previous = ServingReplicaStatus.model_validate(body.get("status") or {})
        observed = observe_pods(kube.list_pods(namespace, naming.replica_selector(name)),
                                spec.placement.gpu_resource)
        ready = [i for i in observed.values()
                 if i.ready and i.pool in POOL_NAMES and not i.draining]
        last_move_s = parse_time_s(previous.pools.last_rebalance_time if previous.pools else None)
        scaling = scaling_in_progress(spec, previous, observed)
        if scaling is not None:
            decision = RebalanceDecision(COOLING_DOWN, scaling, None, None)
        else:
            signals = [s for s in (read_signals(i) for i in sorted(ready, key=lambda i: i.index))
                       if s is not None]
            last_scale_s = parse_time_s(previous.autoscaling.last_scale_time
                                        if previous.autoscaling else None)
            if last_scale_s is not None:
                last_move_s = max(last_move_s or last_scale_s, last_scale_s)
            decision = decide(signals, spec.pools.rebalance, clock(), last_move_s)
        _export_gauges(namespace, name, decision, observed)
        if decision.move is not None:
            _move(kube, body, observed[decision.move.instance], decision.move, decision.reason,
                  event, control_token)
        status = with_rebalance(previous, decision, now_rfc3339(),
                                body["metadata"].get("generation", 0))
        if status != previous:
            kube.patch_replica_status(namespace, name,
                                      status.model_dump(mode="json", by_alias=True))
    return decision


def scaling_in_progress(spec: ServingReplicaSpec, previous: ServingReplicaStatus,
                        observed: dict[str, ObservedInstance]) -> str | None:
    """Why the rebalancer holds this step for the autoscaler, or None."""
    if not spec.autoscaled:
        return None
    if any(i.draining for i in observed.values()):
        return "the autoscaler is draining an instance; rebalancing waits"
    live = sum(1 for i in observed.values() if not i.draining)
    autoscaling = previous.autoscaling
    if autoscaling is not None and autoscaling.desired_instances != live:
        return (f"the autoscaler is changing the count ({live} -> "
                f"{autoscaling.desired_instances}); rebalancing waits")
    return None


def _move(kube: Kube, body: dict, instance: ObservedInstance, move: Move, reason: str,
          event: EventSink, control_token: str | None) -> None:
    namespace = body["metadata"]["namespace"]
    for pod in instance.pods:
        kube.patch_pod_labels(namespace, pod.name, {naming.POOL_LABEL: move.to_pool})
    agent_client.notify_pool(instance, move.to_pool, token=control_token)
    metrics.REBALANCE_MOVES.labels(move.from_pool, move.to_pool).inc()
    event(body, "Normal", "PoolRebalanced",
          f"moved {instance.name} from the {move.from_pool} pool to the {move.to_pool} "
          f"pool: {reason}")


def _export_gauges(namespace: str, name: str, decision: RebalanceDecision,
                   observed: dict[str, ObservedInstance]) -> None:
    replica = metrics.replica_label(namespace, name)
    move = decision.move
    pools_after = [move.to_pool if move is not None and i.name == move.instance else i.pool
                   for i in observed.values()]
    for pool, pressure in (("short", decision.pressure_short), ("long", decision.pressure_long)):
        if pressure is not None:
            metrics.POOL_PRESSURE.labels(replica, pool).set(pressure)
        metrics.POOL_INSTANCES.labels(replica, pool).set(pools_after.count(pool))


def period_s(kube: Kube, namespace: str, name: str) -> float:
    body = kube.get_replica(namespace, name)
    if body is None:
        return IDLE_CHECK_S
    pools = ServingReplicaSpec.model_validate(body["spec"]).pools
    if pools is None or not pools.rebalance.enabled:
        return IDLE_CHECK_S
    return float(pools.rebalance.period_seconds)


async def run(kube: Kube, namespace: str, name: str, stopped: Stopped, *,
              event: EventSink, logger, control_token: str | None = None) -> None:
    """The daemon body: step, sleep a period, until kopf stops it (deletion, shutdown)."""
    async def step() -> None:
        decision = await asyncio.to_thread(rebalance_step, kube, namespace, name, event=event,
                                           control_token=control_token)
        if decision is not None:
            logger.debug(f"rebalance: {decision.outcome}: {decision.reason}")

    await every_period(stopped, lambda: period_s(kube, namespace, name), step, "rebalance",
                       logger)
