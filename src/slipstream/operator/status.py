"""The ServingReplica's status, computed from what reconcile observed and did. Pure.

    InstancePlan (kept instances) + created placements + placement failure + previous status
      --build_status--> status dict (camelCase) --> PATCH servingreplicas/status

Conditions follow the Kubernetes convention: ``lastTransitionTime`` changes only when the
condition's status changes. ``PoolsBalanced`` and the pool pressures belong to the rebalancer;
reconcile carries them over untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.crds.replica_status import (
    Condition, DisaggregationStatus, InstanceStatus, PoolPressure, PoolsStatus, RankStatus,
    RoleStatus, ServingReplicaStatus)
from slipstream.crds.servingreplica import DECODE_ROLE, PREFILL_ROLE, ServingReplicaSpec
from slipstream.operator import naming
from slipstream.operator.instances import ObservedInstance, instance_role
from slipstream.operator.placement import InstancePlacement, PlacementFailure
from slipstream.decisions.pools import BALANCED, MOVED, NO_STATS, RebalanceDecision

PLACED, READY, DEGRADED, POOLS_BALANCED = "Placed", "Ready", "Degraded", "PoolsBalanced"


@dataclass(frozen=True)
class CreatedInstance:
    name: str
    pool: str
    placement: InstancePlacement
    pod_names: tuple[str, ...]


def instance_status(instance: ObservedInstance) -> InstanceStatus:
    return InstanceStatus(name=instance.name, pool=instance.pool, ready=instance.ready, ranks=[
        RankStatus(rank=pod.rank, node=pod.node or "", pod=pod.name, gpus=pod.gpus)
        for pod in instance.pods])


def created_status(created: CreatedInstance) -> InstanceStatus:
    return InstanceStatus(name=created.name, pool=created.pool, ready=False, ranks=[
        RankStatus(rank=rank, node=share.node, pod=pod, gpus=share.gpus)
        for rank, (share, pod) in enumerate(zip(created.placement.shares, created.pod_names))])


def set_condition(conditions: list[Condition], new: Condition, now: str) -> list[Condition]:
    """Replace the condition of ``new.type``, keeping its transition time if status held."""
    old = next((c for c in conditions if c.type == new.type), None)
    since = old.last_transition_time if old and old.status == new.status else now
    updated = new.model_copy(update={"last_transition_time": since})
    return [c for c in conditions if c.type != new.type] + [updated]


def build_status(*, replica: str, namespace: str, spec: ServingReplicaSpec, generation: int,
                 kept: list[ObservedInstance], created: list[CreatedInstance],
                 failure: PlacementFailure | None, previous: ServingReplicaStatus,
                 now: str, desired: int | None = None) -> ServingReplicaStatus:
    """``desired``: the count reconcile aimed at (default spec.instances; the autoscaler's
    when it is on). Draining instances are not in ``kept``: they no longer serve."""
    instances = sorted([instance_status(i) for i in kept] + [created_status(c) for c in created],
                       key=lambda s: _index(s.name))
    instances = [i.model_copy(update={"role": instance_role(spec, i.pool)}) for i in instances]
    if desired is None:
        desired = spec.disaggregation.instances if spec.disaggregation else spec.instances
    placed = len(instances)
    ready = sum(1 for i in instances if i.ready)
    conditions = list(previous.conditions)
    if spec.pools is None:
        conditions = [c for c in conditions if c.type != POOLS_BALANCED]

    if failure is None:
        placed_condition = Condition(type=PLACED, status="True", reason="AllInstancesPlaced",
                                     message=f"{placed} of {desired} instances placed")
    else:
        placed_condition = Condition(type=PLACED, status="False", reason=failure.reason,
                                     message=f"{placed} of {desired} instances placed: "
                                             f"{failure.message}")
    # More ready than desired happens during a rolling update's surge: still all ready.
    all_ready = ready >= desired
    ready_condition = Condition(
        type=READY, status="True" if all_ready else "False",
        reason="AllInstancesReady" if all_ready else "InstancesNotReady",
        message=f"{ready} of {desired} instances ready")
    degraded_condition = _degraded(previous, failure, placed, ready, desired, instances)
    for condition in (placed_condition, ready_condition, degraded_condition):
        conditions = set_condition(conditions, condition.model_copy(
            update={"observed_generation": generation}), now)

    if all_ready:
        phase = "Ready"
    elif degraded_condition.status == "True":
        phase = "Degraded"
    elif placed == 0:
        phase = "Pending"
    else:
        phase = "Progressing"
    pools = None
    if spec.pools is not None:
        old = previous.pools
        pools = PoolsStatus(short=sum(1 for i in instances if i.pool == "short"),
                            long=sum(1 for i in instances if i.pool == "long"),
                            pressure=old.pressure if old else None,
                            last_rebalance_time=old.last_rebalance_time if old else None)
    return ServingReplicaStatus(
        phase=phase, observed_generation=generation, conditions=conditions, replicas=placed,
        ready_instances=ready, ready=f"{ready}/{desired}",
        selector=naming.replica_selector(replica), instances=instances, pools=pools,
        autoscaling=previous.autoscaling if spec.autoscaled else None,
        disaggregation=_disaggregation(spec, instances),
        endpoint=naming.endpoint(replica, namespace))


def _disaggregation(spec: ServingReplicaSpec,
                    instances: list[InstanceStatus]) -> DisaggregationStatus | None:
    if spec.disaggregation is None:
        return None

    def role(name: str, desired: int) -> RoleStatus:
        members = [i for i in instances if i.role == name]
        ready = sum(1 for i in members if i.ready)
        return RoleStatus(instances=len(members), ready_instances=ready,
                          ready=f"{ready}/{desired}")
    return DisaggregationStatus(
        prefill=role(PREFILL_ROLE, spec.disaggregation.prefill.instances),
        decode=role(DECODE_ROLE, spec.disaggregation.decode.instances))


def _degraded(previous: ServingReplicaStatus, failure: PlacementFailure | None, placed: int,
              ready: int, desired: int, instances: list[InstanceStatus]) -> Condition:
    """Degraded means "was or is partly serving, with less than asked": a partial placement,
    or instances lost after the replica had been ready. A first rollout is not degraded."""
    if failure is not None and placed > 0:
        return Condition(type=DEGRADED, status="True", reason="PartiallyPlaced",
                         message=f"only {placed} of {desired} instances fit the cluster")
    if ready < desired and previous.phase in ("Ready", "Degraded"):
        waiting = ", ".join(i.name for i in instances if not i.ready) or "none placed"
        return Condition(type=DEGRADED, status="True", reason="InstancesRecovering",
                         message=f"{ready} of {desired} instances ready; waiting for {waiting}")
    return Condition(type=DEGRADED, status="False", reason="AsExpected", message="")


def _index(instance_name: str) -> int:
    tail = instance_name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def with_rebalance(previous: ServingReplicaStatus, decision: RebalanceDecision, now: str,
                   generation: int) -> ServingReplicaStatus:
    """The status after one rebalancer step: pressures, the PoolsBalanced condition and, for a
    move, the moved instance's pool and the pool counts."""
    instances = previous.instances
    last_rebalance_time = previous.pools.last_rebalance_time if previous.pools else None
    move = decision.move
    if move is not None:
        instances = [i.model_copy(update={"pool": move.to_pool})
                     if i.name == move.instance else i for i in instances]
        last_rebalance_time = now
    pools = PoolsStatus(
        short=sum(1 for i in instances if i.pool == "short"),
        long=sum(1 for i in instances if i.pool == "long"),
        pressure=PoolPressure(short=_rounded(decision.pressure_short),
                              long=_rounded(decision.pressure_long)),
        last_rebalance_time=last_rebalance_time)
    balanced = {MOVED: "False", BALANCED: "True", NO_STATS: "Unknown"}.get(decision.outcome,
                                                                          "False")
    message = decision.reason
    if move is not None:
        message = f"moved {move.instance} from {move.from_pool} to {move.to_pool}: {message}"
    condition = Condition(type=POOLS_BALANCED, status=balanced, reason=decision.outcome,
                          message=message, observed_generation=generation)
    return previous.model_copy(update={
        "instances": instances, "pools": pools,
        "conditions": set_condition(list(previous.conditions), condition, now)})


def _rounded(value: float | None) -> float | None:
    # Status is read by people and diffed by the operator: four decimals is plenty.
    return None if value is None else round(value, 4)
