"""Reconcile one ServingReplica: make the children match the spec, then write the status.

    trigger (create/update/resume, timer, a child pod changed) --reconcile()-->
      GET the replica (under a per-replica lock), ensure ConfigMap + client Services
        (+ with spec.pools or spec.disaggregation: the router's ServiceAccount, RoleBinding
        and Deployment)
      pods --observe_pods--> plan_rollout (rolling update: instances whose template hash
        is not the spec's are drained one at a time, after a surge instance is Ready)
        --> plan_instances --> tear down failed/excess instances
        (with spec.autoscaling: the autoscaler's desired count; draining instances, its own
        and the rolling update's, are left to its loop, handle_autoscale.py)
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

from slipstream.crds.replica_status import ServingReplicaStatus
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, metrics, naming, router
from slipstream.operator.capacity import gpu_nodes, toleration_rules
from slipstream.operator.control_credentials import ControlCredentials
from slipstream.operator.instances import (
    ObservedInstance, Rollout, observe_pods, plan_step)
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
              event: EventSink, control: ControlCredentials = ControlCredentials()
              ) -> Reconciled | None:
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
            result = _reconcile_locked(kube, body, adopt=adopt, event=event, control=control)
    except Exception:
        metrics.RECONCILES.labels("error").inc()
        metrics.RECONCILE_ERRORS.inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
    metrics.RECONCILES.labels("success").inc()
    return result


def _reconcile_locked(kube: Kube, body: dict, *, adopt: Adopt, event: EventSink,
                      control: ControlCredentials) -> Reconciled:
    metadata = body["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    spec = ServingReplicaSpec.model_validate(body["spec"])
    previous = ServingReplicaStatus.model_validate(body.get("status") or {})
    _ensure_shared_children(kube, body, spec, adopt, previous_had_router=(
        previous.pools is not None or previous.disaggregation is not None))
    token = control.token(namespace, name)
    if token is not None:
        # Create only: the operator may not read Secrets, and the token is derived, so an
        # existing one is already right (docs/tenancy.md says how to rotate).
        secret = builders.build_control_secret_spec(name, namespace, token)
        adopt(secret, body)
        kube.create(secret)

    resource = spec.placement.gpu_resource
    everything = observe_pods(kube.list_pods(namespace, naming.replica_selector(name)), resource)
    step = plan_step(spec, everything, {i.name: i.pool for i in previous.instances}, name,
                     autoscaler_desired=(previous.autoscaling.desired_instances
                                         if previous.autoscaling else None),
                     template_hash=builders.template_hash(spec),
                     surge_fits=lambda: _one_more_fits(kube, spec),
                     new_pools=(previous.autoscaling.add_pools
                                if spec.autoscaled and previous.autoscaling else ()))
    rollout, plan, desired, draining = step.rollout, step.plan, step.desired, step.draining
    if rollout.drain is not None:
        _drain_outdated(kube, body, rollout, event)
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
                if rollout.outdated and draining:
                    continue  # a rolling update without room to spare: the drain frees it
                failure = outcome
                metrics.PLACEMENT_FAILURES.inc()
            else:
                created.append(_create_instance(kube, body, spec, index, pool, outcome, adopt,
                                                control.enabled))
    if failure is not None and not _already_reported(previous, failure):
        event(body, "Warning", failure.reason, f"cannot place instance(s): {failure.message}")

    status = build_status(replica=name, namespace=namespace, spec=spec,
                          generation=metadata.get("generation", 0), kept=list(plan.keep),
                          created=created, failure=failure, previous=previous,
                          now=now_rfc3339(), desired=desired)
    if status != previous:
        kube.patch_replica_status(namespace, name, status.model_dump(mode="json", by_alias=True))
    return Reconciled(status, failure)


def mark_draining(kube: Kube, namespace: str, instance: ObservedInstance, now_s: float) -> None:
    """Take an instance out of rotation (scale-down or rolling update): every pod is marked;
    the controller's role label changes so that the client Service and the router (both
    select role=controller) drop it. The autoscaler's loop deletes it once idle
    (handle_autoscale.finish_drains)."""
    for pod in instance.pods:
        labels = {naming.DRAINING_LABEL: "true"}
        if pod.rank == 0:
            labels[naming.ROLE_LABEL] = naming.ROLE_DRAINING
        kube.patch_pod_labels(namespace, pod.name, labels,
                              annotations={naming.DRAINING_SINCE_ANNOTATION: f"{now_s:.3f}"})


def _drain_outdated(kube: Kube, body: dict, rollout: Rollout, event: EventSink) -> None:
    instance = rollout.drain
    assert instance is not None
    mark_draining(kube, body["metadata"]["namespace"], instance, time.time())
    left = len(rollout.outdated) - 1
    how = ("its replacement is Ready" if rollout.surged else
           "no room for one more instance: its replacement starts in its place")
    event(body, "Normal", "RollingUpdate",
          f"{instance.name} was built from an older spec (template {instance.template_hash}); "
          f"draining it, {how} ({left} more outdated)")


def _one_more_fits(kube: Kube, spec: ServingReplicaSpec) -> bool:
    """Whether the cluster has room for one more instance now (a rolling update's surge)."""
    nodes = gpu_nodes(kube.list_nodes(), kube.list_active_pods_everywhere(),
                      spec.placement.gpu_resource)
    return not isinstance(place_instances(placement_request(spec), nodes, 1)[0],
                          PlacementFailure)


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
        ep=spec.parallelism.expert_parallel,
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
                     placement: InstancePlacement, adopt: Adopt,
                     control_auth: bool) -> CreatedInstance:
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
            share=share, rank=rank, num_ranks=len(placement.shares), pool=pool,
            control_auth=control_auth)
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
