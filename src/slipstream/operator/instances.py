"""What the cluster holds for a ServingReplica, and what to change: the pure core of reconcile.

    pods (labelled by the builders) --observe_pods--> {instance: ObservedInstance}
      + spec.instances + pool memory --plan_instances--> InstancePlan
      --> handle_reconcile: delete torn-down instances, place and create new ones

An instance is healthy only as a whole: every rank present, none failed, none deleting. A pod
that fails or disappears takes its whole instance down (NCCL groups do not survive a member),
and the instance comes back under the same name and pool with a new incarnation.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slipstream.crds.servingreplica import (
    DECODE_POOL, DECODE_ROLE, POOL_NAMES, PREFILL_ROLE, UNIFIED_POOL, ServingReplicaSpec)
from slipstream.operator import naming
from slipstream.operator.capacity import pod_gpu_request


@dataclass(frozen=True)
class ObservedPod:
    name: str
    instance: str
    index: int
    incarnation: str
    rank: int
    num_ranks: int
    pool: str
    node: str | None
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    ready: bool
    deleting: bool
    gpus: int
    ip: str | None = None
    draining_since_s: float | None = None  # set once chosen for removal (scale-down, update)
    template_hash: str | None = None  # builders.template_hash of the spec it was built from

    @property
    def failed(self) -> bool:
        # Succeeded counts as failed too: an agent is never supposed to exit.
        return self.phase in ("Failed", "Succeeded") or self.deleting


@dataclass(frozen=True)
class ObservedInstance:
    name: str
    index: int
    pods: tuple[ObservedPod, ...]

    @property
    def incarnations(self) -> set[str]:
        return {pod.incarnation for pod in self.pods}

    @property
    def complete(self) -> bool:
        """One incarnation with every rank present."""
        if len(self.incarnations) != 1:
            return False
        ranks = {pod.rank for pod in self.pods}
        return ranks == set(range(self.pods[0].num_ranks))

    @property
    def failed(self) -> bool:
        return not self.complete or any(pod.failed for pod in self.pods)

    @property
    def ready(self) -> bool:
        return not self.failed and all(pod.ready for pod in self.pods)

    @property
    def pool(self) -> str:
        return self.controller.pool if self.controller else self.pods[0].pool

    @property
    def controller(self) -> ObservedPod | None:
        return next((pod for pod in self.pods if pod.rank == 0), None)

    @property
    def draining_since_s(self) -> float | None:
        """When its drain began; None for an instance that is not draining."""
        times = [pod.draining_since_s for pod in self.pods if pod.draining_since_s is not None]
        return min(times) if times else None

    @property
    def draining(self) -> bool:
        return self.draining_since_s is not None

    @property
    def template_hash(self) -> str | None:
        """The spec hash its pods were built from (None: built before pods carried one)."""
        lead = self.controller or self.pods[0]
        return lead.template_hash


@dataclass(frozen=True)
class InstancePlan:
    keep: tuple[ObservedInstance, ...]
    tear_down: tuple[ObservedInstance, ...]  # failed, partial or beyond spec.instances
    restarts: tuple[str, ...]  # names of instances torn down because they failed
    create: tuple[tuple[int, str], ...]  # (index, pool) of instances to place and create


def observe_pod(pod: dict, gpu_resource: str) -> ObservedPod | None:
    """Parse one agent pod; None for pods that lack our labels (not ours to manage)."""
    metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    labels = metadata.get("labels") or {}
    try:
        index = int(labels[naming.INSTANCE_INDEX_LABEL])
        rank = int(labels[naming.RANK_LABEL])
        num_ranks = int(labels[naming.NUM_RANKS_LABEL])
        instance, incarnation = labels[naming.INSTANCE_LABEL], labels[naming.INCARNATION_LABEL]
    except (KeyError, ValueError):
        return None
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    draining_since_s = None
    if labels.get(naming.DRAINING_LABEL) == "true":
        since = (metadata.get("annotations") or {}).get(naming.DRAINING_SINCE_ANNOTATION, "0")
        try:
            draining_since_s = float(since)
        except ValueError:
            draining_since_s = 0.0  # marked by hand without a time: long past its bound
    return ObservedPod(
        name=metadata["name"], instance=instance, index=index, incarnation=incarnation,
        rank=rank, num_ranks=num_ranks, pool=labels.get(naming.POOL_LABEL, UNIFIED_POOL),
        node=spec.get("nodeName"), phase=status.get("phase", "Pending"),
        ready=conditions.get("Ready") == "True",
        deleting=metadata.get("deletionTimestamp") is not None,
        gpus=pod_gpu_request(pod, gpu_resource), ip=status.get("podIP"),
        draining_since_s=draining_since_s,
        template_hash=labels.get(naming.TEMPLATE_HASH_LABEL))


def observe_pods(pods: list[dict], gpu_resource: str) -> dict[str, ObservedInstance]:
    by_instance: dict[str, list[ObservedPod]] = {}
    for pod in pods:
        observed = observe_pod(pod, gpu_resource)
        if observed is not None:
            by_instance.setdefault(observed.instance, []).append(observed)
    return {name: ObservedInstance(name=name, index=members[0].index,
                                   pods=tuple(sorted(members, key=lambda p: (p.rank, p.name))))
            for name, members in by_instance.items()}


def plan_instances(spec: ServingReplicaSpec, observed: dict[str, ObservedInstance],
                   remembered_pools: dict[str, str], replica: str, *,
                   count: int | None = None, reserved: frozenset[int] = frozenset(),
                   new_pools: Sequence[str] = ()) -> InstancePlan:
    """Decide which instances stay, which go, and which to create (with their pools).

    ``remembered_pools`` maps instance names to the pool the status last recorded, so an
    instance whose pods are all gone comes back in the pool it had (a rebalance move sticks).
    ``count`` is how many instances to run (default spec.instances; the autoscaler's desired
    count when it is on); ``reserved`` indices are not reused (draining instances hold them).
    ``new_pools``: the pools the autoscaler chose for the instances its last scale-up added;
    the last ones apply to the instances still to create (earlier ones may be placed).
    """
    count = spec.instances if count is None else count
    slots = _surviving_slots(spec, sorted(observed.values(), key=lambda i: i.index), count)
    tear_down = [i for i in observed.values() if i not in slots]
    keep, restarts, create = [], [], []
    pools = Counter(i.pool for i in slots if not i.failed)
    for instance in slots:
        if not instance.failed:
            keep.append(instance)
            continue
        tear_down.append(instance)
        restarts.append(instance.name)
        pool = instance.pool if _valid_pool(instance.pool, spec) else _pool_for_new(spec, pools)
        pools[pool] += 1
        create.append((instance.index, pool))
    used = {instance.index for instance in slots} | reserved
    free_indices = (i for i in itertools.count() if i not in used)
    missing = max(0, count - len(slots))
    chosen = list(new_pools[-missing:]) if missing else []
    for index in itertools.islice(free_indices, missing):
        remembered = remembered_pools.get(naming.instance_name(replica, index))
        wanted = chosen.pop(0) if chosen else None
        if remembered and _valid_pool(remembered, spec) and \
                _role_has_room(spec, pools, remembered):
            pool = remembered
        elif wanted and _valid_pool(wanted, spec) and _role_has_room(spec, pools, wanted):
            pool = wanted
        else:
            pool = _pool_for_new(spec, pools)
        pools[pool] += 1
        create.append((index, pool))
    return InstancePlan(keep=tuple(keep), tear_down=tuple(sorted(tear_down, key=lambda i: i.index)),
                        restarts=tuple(restarts), create=tuple(sorted(create)))


def instance_role(spec: ServingReplicaSpec, pool: str) -> str | None:
    """prefill or decode for an instance of a disaggregated replica (decode instances are
    the ``decode`` pool; every prefill pool is the prefill role); None for mixed instances."""
    if spec.disaggregation is None:
        return None
    return DECODE_ROLE if pool == DECODE_POOL else PREFILL_ROLE


@dataclass(frozen=True)
class Rollout:
    """One reconcile's step of a rolling update (see ``plan_rollout``)."""

    count: int  # live instances to run now (the drained one not counted): desired, or one
    #             more while a surge instance starts
    drain: ObservedInstance | None  # the outdated instance to take out of rotation now
    outdated: tuple[str, ...]  # live instances built from an older spec
    surged: bool = False  # the drain comes after a surge instance is Ready (room to spare)
    # The pool (and so the role) of a surge instance: that of the outdated instance it will
    # replace, so that pool sizes and prefill/decode counts hold through the rollout.
    surge_pool: str | None = None


def plan_rollout(live: dict[str, ObservedInstance], desired: int, template_hash: str, *,
                 any_draining: bool, surge_fits: Callable[[], bool]) -> Rollout:
    """Replace instances built from an older spec one at a time, never below ``desired``
    serving instances where the cluster has room for one more.

    ``live``: the instances not draining. Each step waits until every live instance is
    Ready and no instance is still draining (so an instance's requests have moved before
    the next goes). Then, if one more instance fits (``surge_fits``, asked only then), the
    count goes to desired + 1: a new instance built from the current spec starts beside the
    old ones. Once it is Ready, the lowest-indexed outdated instance is drained (the
    autoscaler's drain: out of the Service and the router at once, deleted when idle, then
    the agent's own SIGTERM drain). Without room for a surge, the outdated instance is
    drained first and its replacement is placed where it was. A failed outdated instance
    needs no drain: reconcile recreates it from the current spec anyway."""
    outdated = sorted((i for i in live.values()
                       if i.template_hash != template_hash and not i.failed),
                      key=lambda i: i.index)
    names = tuple(i.name for i in outdated)
    if not outdated or desired <= 0:
        return Rollout(count=desired, drain=None, outdated=names)
    all_ready = all(i.ready for i in live.values())
    if len(live) > desired:  # a surge instance runs (or starts): keep it until it is Ready
        if all_ready and not any_draining:  # then the oldest goes and the count is back
            return Rollout(count=desired, drain=outdated[0], outdated=names, surged=True)
        return Rollout(count=desired + 1, drain=None, outdated=names,
                       surge_pool=outdated[0].pool)
    if any_draining or not all_ready or len(live) < desired:
        return Rollout(count=desired, drain=None, outdated=names)
    if surge_fits():
        return Rollout(count=desired + 1, drain=None, outdated=names,
                       surge_pool=outdated[0].pool)
    return Rollout(count=desired, drain=outdated[0], outdated=names)


@dataclass(frozen=True)
class Step:
    """What one reconcile does to the instances (``plan_step``)."""

    rollout: Rollout
    plan: InstancePlan
    desired: int  # the count the status reports against
    draining: frozenset[int]  # indices held by draining instances (with rollout.drain's)


def plan_step(spec: ServingReplicaSpec, everything: dict[str, ObservedInstance],
              remembered_pools: dict[str, str], replica: str, *,
              autoscaler_desired: int | None, template_hash: str,
              surge_fits: Callable[[], bool], new_pools: Sequence[str] = ()) -> Step:
    """Reconcile's whole decision over the observed instances: the rolling update's step
    (which outdated instance to drain, whether to surge), then plan_instances over the
    instances left in rotation. Draining instances are not counted and keep their indices;
    the autoscaler's loop deletes them. ``new_pools``: the autoscaler's choice for the
    instances its last scale-up added (plan_instances)."""
    observed = {k: i for k, i in everything.items() if not i.draining}
    draining = frozenset(i.index for i in everything.values() if i.draining)
    desired = target_count(spec, autoscaler_desired, len(observed))
    rollout = plan_rollout(observed, desired, template_hash, any_draining=bool(draining),
                           surge_fits=surge_fits)
    count = rollout.count
    if rollout.drain is not None:
        del observed[rollout.drain.name]
        draining = draining | {rollout.drain.index}
    if spec.autoscaled:  # only the autoscaler scales down (a drain)
        count = max(count, len(observed))
        if not rollout.outdated:
            desired = max(desired, len(observed))
    plan = plan_instances(spec, observed, remembered_pools, replica, count=count,
                          reserved=draining, new_pools=new_pools)
    # The surge instance (a new index) takes its pool, unless the spec no longer has that
    # pool (spec.pools or spec.disaggregation was dropped): then the pool plan_instances chose.
    if rollout.surge_pool is not None and _valid_pool(rollout.surge_pool, spec):
        known = {i.index for i in observed.values()}
        plan = dataclasses.replace(plan, create=tuple(
            (index, pool if index in known else rollout.surge_pool)
            for index, pool in plan.create))
    return Step(rollout=rollout, plan=plan, desired=desired, draining=draining)


def target_count(spec: ServingReplicaSpec, desired: int | None, live: int) -> int:
    """How many instances reconcile runs. Without autoscaling, spec.instances. With it, the
    autoscaler's last desired count, never below minInstances; before its first decision
    (``desired`` None), the instances already running, within [minInstances, maxInstances]
    (switching autoscaling on never scales down without a drain). Only the autoscaler scales
    down, by draining: a lowered maxInstances is not enforced here."""
    if spec.disaggregation is not None:  # the CRD rules out autoscaling with it
        return spec.disaggregation.instances
    autoscaling = spec.autoscaling
    if autoscaling is None or not autoscaling.enabled:
        return spec.instances
    if desired is None:
        return min(autoscaling.max_instances, max(autoscaling.min_instances, live))
    return max(autoscaling.min_instances, desired)


def _surviving_slots(spec: ServingReplicaSpec, instances: list[ObservedInstance],
                     count: int) -> list[ObservedInstance]:
    """The instances that keep their slot when scaling down: failed ones go first, then the
    highest indices, but never taking a pool below minPerPool while another choice exists."""
    if spec.disaggregation is not None:
        # Each role keeps at most its own count: a changed prefill:decode ratio removes
        # instances of the role that shrank even when the total stays.
        decode = [i for i in instances if i.pool == DECODE_POOL]
        prefill = [i for i in instances if i.pool != DECODE_POOL]
        victims = _victims(spec, decode, len(decode) - spec.disaggregation.decode.instances) + \
            _victims(spec, prefill, len(prefill) - spec.disaggregation.prefill.instances)
        # A rolling update's surge instance (count above the roles' sum) keeps its slot
        # beyond its role's count until the outdated instance it replaces has drained.
        surge = max(0, count - spec.disaggregation.instances)
        spared = [i for i in victims if not i.failed][:surge]
        victims = [i for i in victims if i not in spared]
    else:
        victims = _victims(spec, instances, len(instances) - count)
    return [i for i in instances if i not in victims]


def _victims(spec: ServingReplicaSpec, instances: list[ObservedInstance],
             excess: int) -> list[ObservedInstance]:
    if excess <= 0:
        return []
    counts = Counter(i.pool for i in instances)
    floor = spec.pools.rebalance.min_per_pool if spec.pools and spec.pools.rebalance.enabled \
        else 0
    candidates = sorted(instances, key=lambda i: (not i.failed, -i.index))
    victims: list[ObservedInstance] = []
    for instance in candidates:
        if len(victims) < excess and counts[instance.pool] > floor:
            victims.append(instance)
            counts[instance.pool] -= 1
    for instance in candidates:  # the floor could not be kept: highest indices go anyway
        if len(victims) < excess and instance not in victims:
            victims.append(instance)
    return victims


def _valid_pool(pool: str, spec: ServingReplicaSpec) -> bool:
    if pool == DECODE_POOL:
        return spec.disaggregation is not None
    return pool in POOL_NAMES if spec.pools is not None else pool == UNIFIED_POOL


def _role_has_room(spec: ServingReplicaSpec, pools: Counter[str], pool: str) -> bool:
    """Whether one more instance of ``pool``'s role stays within its count."""
    if spec.disaggregation is None:
        return True
    decode = pools[DECODE_POOL]
    if pool == DECODE_POOL:
        return decode < spec.disaggregation.decode.instances
    return sum(pools.values()) - decode < spec.disaggregation.prefill.instances


def _pool_for_new(spec: ServingReplicaSpec, pools: Counter[str]) -> str:
    """With disaggregation, prefill instances first, then decode ones. Prefill (or mixed)
    instances fill the short pool up to spec.pools.short, then the long pool (the CRD's rules
    make sure that leaves the long pool its minPerPool on a fresh rollout)."""
    prefill_pool = UNIFIED_POOL
    if spec.pools is not None:
        prefill_pool = "short" if pools["short"] < spec.pools.short else "long"
    if spec.disaggregation is not None and not _role_has_room(spec, pools, prefill_pool):
        return DECODE_POOL
    return prefill_pool
