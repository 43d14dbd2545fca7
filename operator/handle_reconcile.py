"""Reconcile one ServingReplica: make the children match the spec, then write the status.

    trigger (create/update/resume, timer, a child pod changed) --reconcile()-->
      GET the replica (under a per-replica lock), ensure ConfigMap + client Services
        (+ with spec.pools or spec.disaggregation: the router's ServiceAccount, RoleBinding
        and Deployment)
      pods --observe_pods--> plan_instances --> tear down failed/excess instances
        (with spec.autoscaling: the autoscaler's desired count; its draining instances are
        left to it, handle_autoscale.py)
      nodes + pods everywhere --gpu_nodes--> place_instances --> create pods
      build_status --> PATCH status; Events for restarts and placement failures

Level-based and idempotent: it reads the cluster every time and keeps no memory between
runs, so an operator restart (or a second trigger) converges instead of duplicating children.
Runs of the same replica are serialised by a per-replica lock, because the triggers arrive
on different threads.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from slipstream.crds.servingreplica import ServingReplicaSpec, ServingReplicaStatus
from slipstream.operator import builders, metrics, naming, router
from slipstream.operator.capacity import gpu_nodes, toleration_rules
from slipstream.operator.instances import (
    ObservedInstance, observe_pods, plan_instances, target_count)
from slipstream.operator.kube import Kube
from slipstream.operator.placement import (
    InstancePlacement, PlacementFailure, PlacementRequest, place_instances)
from slipstream.operator.status import CreatedInstance, build_status

# (body of the owner, event type "Normal"/"Warning", reason, message)
EventSink = Callable[[dict, str, str, str], None]
Adopt = Callable[[dict, dict], None]  # (child manifest, owner body): sets ownerReferences

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def replica_lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Reconciled:
    status: ServingReplicaStatus
    placement_failure: PlacementFailure | None  # why instances are missing, if they are


def reconcile(kube: Kube, namespace: str, name: str, *, adopt: Adopt,
              event: EventSink) -> Reconciled | None:
    """Converge one replica and return its new status; None when it is gone or being
    deleted (garbage collection takes over). The replica is read afresh under the lock: a
    body handed over by a trigger may predate the last status write (a rebalance move), and
    the status written here must derive from the stored one."""
    started = time.perf_counter()
    try:
        with replica_lock(namespace, name):
            body = kube.get_replica(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return None
            result = _reconcile_locked(kube, body, adopt=adopt, event=event)
    except Exception:
        metrics.RECONCILES.labels("error").inc()
        metrics.RECONCILE_ERRORS.inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
    metrics.RECONCILES.labels("success").inc()
    return result


def _reconcile_locked(kube: Kube, body: dict, *, adopt: Adopt, event: EventSink
                      ) -> Reconciled:
    metadata = body["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    spec = ServingReplicaSpec.model_validate(body["spec"])
    previous = ServingReplicaStatus.model_validate(body.get("status") or {})
    _ensure_shared_children(kube, body, spec, adopt, previous_had_router=(
        previous.pools is not None or previous.disaggregation is not None))

    resource = spec.placement.gpu_resource
    everything = observe_pods(kube.list_pods(namespace, naming.replica_selector(name)), resource)
    observed = {k: i for k, i in everything.items() if not i.draining}
    draining = frozenset(i.index for i in everything.values() if i.draining)
    desired = target_count(spec, previous.autoscaling.desired_instances
                           if previous.autoscaling else None, len(observed))
    if spec.autoscaled:
        desired = max(desired, len(observed))  # only the autoscaler scales down (a drain)
    plan = plan_instances(spec, observed, {i.name: i.pool for i in previous.instances}, name,
                          count=desired, reserved=draining)
    recreated = {index for index, _ in plan.create}
    for instance in plan.tear_down:
        _tear_down(kube, namespace, instance, keep_service=instance.index in recreated)
    for instance_name in plan.restarts:
        metrics.INSTANCE_RESTARTS.inc()
        event(body, "Warning", "InstanceRestarted",
              f"{instance_name}: a pod failed or disappeared; recreating the whole instance")

    created: list[CreatedInstance] = []
    failure: PlacementFailure | None = None
    if plan.create:
        nodes = gpu_nodes(kube.list_nodes(), kube.list_active_pods_everywhere(), resource)
        outcomes = place_instances(placement_request(spec), nodes, len(plan.create))
        for (index, pool), outcome in zip(plan.create, outcomes):
            if isinstance(outcome, PlacementFailure):
                failure = outcome
                metrics.PLACEMENT_FAILURES.inc()
            else:
                created.append(_create_instance(kube, body, spec, index, pool, outcome, adopt))
    if failure is not None and not _already_reported(previous, failure):
        event(body, "Warning", failure.reason, f"cannot place instance(s): {failure.message}")

    status = build_status(replica=name, namespace=namespace, spec=spec,
                          generation=metadata.get("generation", 0), kept=list(plan.keep),
                          created=created, failure=failure, previous=previous,
                          now=now_rfc3339(), desired=desired)
    if status != previous:
        kube.patch_replica_status(namespace, name, status.model_dump(mode="json", by_alias=True))
    return Reconciled(status, failure)


def owner_of(event_type: str | None, pod: dict) -> tuple[str, str] | None:
    """(namespace, name) of the ServingReplica to reconcile after an event on one of its
    pods. The initial listing (no event type) is skipped: resume handlers cover start-up."""
    if event_type is None:
        return None
    metadata = pod["metadata"]
    owner_name = (metadata.get("labels") or {}).get(naming.REPLICA_LABEL)
    return (metadata["namespace"], owner_name) if owner_name else None


def placement_request(spec: ServingReplicaSpec) -> PlacementRequest:
    placement = spec.placement
    return PlacementRequest(
        tp=spec.parallelism.tp, spp=spec.parallelism.spp, kvp=spec.parallelism.kvp,
        gpus_per_node=placement.gpus_per_node, node_selector=dict(placement.node_selector),
        tolerations=toleration_rules([t.to_api() for t in placement.tolerations]))


def _ensure_shared_children(kube: Kube, body: dict, spec: ServingReplicaSpec,
                            adopt: Adopt, *, previous_had_router: bool) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    with_router = router.wants_router(spec)
    wanted = [builders.build_config_map_spec(name, namespace, spec)]
    if with_router:
        # The identity and its read grant first: the router's pods need both to start.
        wanted += [router.build_router_service_account_spec(name, namespace),
                   router.build_router_role_binding_spec(name, namespace),
                   router.build_router_deployment_spec(name, namespace, spec)]
        if spec.pools is not None:
            wanted += [builders.build_client_service_spec(name, namespace, pool)
                       for pool in ("short", "long")]
    wanted.append(builders.build_client_service_spec(name, namespace, via_router=with_router))
    for manifest in wanted:
        adopt(manifest, body)
        kube.ensure(manifest)
    if not with_router and previous_had_router:
        # Pools and disaggregation were dropped from the spec: the client Service now selects
        # the agents, and the router goes (the next status shows neither, so this runs once).
        for kind in ("Deployment", "RoleBinding", "ServiceAccount"):
            kube.delete(kind, namespace, naming.router_name(name))


def _tear_down(kube: Kube, namespace: str, instance: ObservedInstance, *,
               keep_service: bool) -> None:
    for pod in instance.pods:
        if not pod.deleting:
            kube.delete("Pod", namespace, pod.name)
    if not keep_service:
        kube.delete("Service", namespace, instance.name)


def _create_instance(kube: Kube, body: dict, spec: ServingReplicaSpec, index: int, pool: str,
                     placement: InstancePlacement, adopt: Adopt) -> CreatedInstance:
    namespace, replica = body["metadata"]["namespace"], body["metadata"]["name"]
    instance = naming.instance_name(replica, index)
    incarnation = naming.new_incarnation(instance, f"{time.time_ns()}")
    service = builders.build_instance_service_spec(replica, namespace, instance)
    adopt(service, body)
    kube.ensure(service)
    pod_names = []
    for rank, share in enumerate(placement.shares):
        pod = builders.build_agent_pod_spec(
            replica, namespace, spec, instance=instance, index=index, incarnation=incarnation,
            share=share, rank=rank, num_ranks=len(placement.shares), pool=pool)
        adopt(pod, body)
        kube.create(pod)
        pod_names.append(pod["metadata"]["name"])
    metrics.INSTANCES_CREATED.inc()
    return CreatedInstance(name=instance, pool=pool, placement=placement,
                           pod_names=tuple(pod_names))


def _already_reported(previous: ServingReplicaStatus, failure: PlacementFailure) -> bool:
    """One Event per placement problem, not one per reconcile while it lasts."""
    placed = next((c for c in previous.conditions if c.type == "Placed"), None)
    return placed is not None and placed.status == "False" and placed.reason == failure.reason
