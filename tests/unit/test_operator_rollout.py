"""The rolling update's pure parts: which spec changes restart instances (the template hash on
every pod), and the step plan_rollout takes from what reconcile observes."""

from __future__ import annotations

import pytest

from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, naming
from slipstream.operator.instances import (
    ObservedInstance, observe_pods, plan_rollout, plan_step)
from slipstream.operator.placement import NodeShare

GPU = "nvidia.com/gpu"


def spec(**changes) -> ServingReplicaSpec:
    body = {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "a:1",
            "instances": 2, "parallelism": {"tp": 1}}
    body.update(changes)
    return ServingReplicaSpec.model_validate(body)


OLD, NEW = spec(), spec(image="a:2")


def pod(index: int, built_from: ServingReplicaSpec, *, ready: bool = True,
        phase: str = "Running", incarnation: str = "aaaaa") -> dict:
    manifest = builders.build_agent_pod_spec(
        "r", "ns", built_from, instance=naming.instance_name("r", index), index=index,
        incarnation=incarnation, share=NodeShare(node="node-0", gpus=1, first_rank=0), rank=0,
        num_ranks=1, pool="unified")
    manifest["status"] = {"phase": phase, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}
    return manifest


def live(*pods: dict) -> dict[str, ObservedInstance]:
    return observe_pods(list(pods), GPU)


def never() -> bool:
    raise AssertionError("the surge capacity must not be asked for here")


@pytest.mark.parametrize("change", [
    {"image": "a:2"},
    {"model": {"name": "m", "dtype": "float32", "source": {"hostPath": {"path": "/m"}}}},
    {"model": {"name": "m", "source": {"pvc": {"claimName": "weights"}}}},
    {"scheduler": {"policy": "fcfs"}},
    {"parallelism": {"tp": 2}},
    {"drainTimeoutSeconds": 60},
    {"singleProcess": True},
    {"placement": {"nodeSelector": {"pool": "a100"}}},
])
def test_every_change_that_shapes_a_pod_changes_the_template_hash(change):
    assert builders.template_hash(spec(**change)) != builders.template_hash(OLD)


@pytest.mark.parametrize("change", [
    {"instances": 5},
    {"autoscaling": {"maxInstances": 4}},
])
def test_scaling_changes_leave_the_template_hash_alone(change):
    assert builders.template_hash(spec(**change)) == builders.template_hash(OLD)


def test_pool_sizes_leave_the_hash_alone_but_turning_pools_on_changes_it():
    pools = spec(instances=2, pools={"short": 1})
    assert builders.template_hash(spec(instances=2, pools={"short": 2})) == \
        builders.template_hash(pools)
    assert builders.template_hash(pools) != builders.template_hash(OLD)


def test_pods_carry_the_hash_and_observe_reads_it():
    observed = live(pod(0, OLD))
    assert pod(0, OLD)["metadata"]["labels"][naming.TEMPLATE_HASH_LABEL] == \
        builders.template_hash(OLD)
    assert observed["r-0"].template_hash == builders.template_hash(OLD)


def test_up_to_date_instances_need_nothing():
    step = plan_rollout(live(pod(0, NEW), pod(1, NEW)), 2, builders.template_hash(NEW),
                        any_draining=False, surge_fits=never)
    assert (step.count, step.drain, step.outdated) == (2, None, ())


def test_a_whole_rollout_with_room_surges_then_drains_one_at_a_time():
    """Two outdated instances: surge r-2, drain r-0 once r-2 is Ready, wait for the drain,
    surge r-3, drain r-1: never fewer than two Ready instances in rotation."""
    current = builders.template_hash(NEW)

    def step(*pods, draining=False):
        return plan_rollout(live(*pods), 2, current, any_draining=draining,
                            surge_fits=lambda: True)

    first = step(pod(0, OLD), pod(1, OLD))
    assert (first.count, first.drain, first.outdated) == (3, None, ("r-0", "r-1"))
    starting = step(pod(0, OLD), pod(1, OLD), pod(2, NEW, ready=False))
    assert (starting.count, starting.drain) == (3, None)  # the surge waits to be Ready
    swap = step(pod(0, OLD), pod(1, OLD), pod(2, NEW))
    # The count excludes the drained instance: nothing more is created beside the surge.
    assert swap.count == 2 and swap.drain is not None and swap.drain.name == "r-0"
    assert swap.surged
    # r-0 is draining (no longer live): nothing more until it is gone.
    waiting = step(pod(1, OLD), pod(2, NEW), draining=True)
    assert (waiting.count, waiting.drain, waiting.outdated) == (2, None, ("r-1",))
    second = step(pod(1, OLD), pod(2, NEW))
    assert (second.count, second.drain) == (3, None)
    last = step(pod(1, OLD), pod(2, NEW), pod(3, NEW))
    assert last.count == 2 and last.drain is not None and last.drain.name == "r-1"
    done = step(pod(2, NEW), pod(3, NEW), draining=True)
    assert (done.count, done.drain, done.outdated) == (2, None, ())


def test_without_room_for_a_surge_the_outdated_instance_drains_first():
    step = plan_rollout(live(pod(0, OLD), pod(1, OLD)), 2, builders.template_hash(NEW),
                        any_draining=False, surge_fits=lambda: False)
    assert step.count == 2 and step.drain is not None and step.drain.name == "r-0"
    assert not step.surged


@pytest.mark.parametrize("pods, draining", [
    ((pod(0, OLD), pod(1, NEW, ready=False)), False),  # a replacement is still starting
    ((pod(0, OLD), pod(1, OLD)), True),  # an earlier drain has not finished
    ((pod(0, OLD),), False),  # an instance is missing (reconcile places it first)
])
def test_nothing_is_drained_while_the_replica_is_short_of_ready_instances(pods, draining):
    step = plan_rollout(live(*pods), 2, builders.template_hash(NEW), any_draining=draining,
                        surge_fits=never)
    assert (step.count, step.drain) == (2, None)


def test_a_failed_outdated_instance_is_not_drained_reconcile_recreates_it():
    step = plan_rollout(live(pod(0, OLD, phase="Failed"), pod(1, NEW)), 2,
                        builders.template_hash(NEW), any_draining=False, surge_fits=never)
    assert (step.count, step.drain, step.outdated) == (2, None, ())


def test_pods_without_a_hash_are_outdated():
    unlabelled = pod(0, OLD)
    del unlabelled["metadata"]["labels"][naming.TEMPLATE_HASH_LABEL]
    step = plan_rollout(live(unlabelled), 1, builders.template_hash(OLD), any_draining=False,
                        surge_fits=lambda: True)
    assert (step.count, step.outdated) == (2, ("r-0",))


def test_a_replica_scaled_to_zero_never_surges():
    step = plan_rollout(live(pod(0, OLD)), 0, builders.template_hash(NEW), any_draining=False,
                        surge_fits=never)
    assert (step.count, step.drain) == (0, None)


class Cluster:
    """The pods of one replica, changed by reconcile's decisions (``plan_step``) and by the
    world: a starting instance becomes Ready, a drained one is deleted by the drain loop."""

    def __init__(self, *pods: dict) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.created = 0
        self.serving_history: list[int] = []

    def observed(self) -> dict[str, ObservedInstance]:
        return observe_pods(list(self.pods.values()), GPU)

    def reconcile(self, the_spec: ServingReplicaSpec, surge_fits: bool) -> None:
        step = plan_step(the_spec, self.observed(), {}, "r", autoscaler_desired=None,
                         template_hash=builders.template_hash(the_spec),
                         surge_fits=lambda: surge_fits)
        assert not step.plan.tear_down, "an instance went without a drain"
        if step.rollout.drain is not None:
            for observed_pod in step.rollout.drain.pods:
                labels = self.pods[observed_pod.name]["metadata"]["labels"]
                labels[naming.DRAINING_LABEL] = "true"
                labels[naming.ROLE_LABEL] = naming.ROLE_DRAINING
                self.pods[observed_pod.name]["metadata"]["annotations"][
                    naming.DRAINING_SINCE_ANNOTATION] = "1.0"
        for index, _ in step.plan.create:
            self.created += 1
            new = pod(index, the_spec, ready=False, incarnation=f"new{self.created:02d}")
            self.pods[new["metadata"]["name"]] = new
        self.note_serving()

    def world(self) -> bool:
        """One thing happens; False when nothing is left to happen."""
        for manifest in self.pods.values():
            conditions = manifest["status"]["conditions"]
            if conditions[0]["status"] == "False":
                conditions[0]["status"] = "True"
                self.note_serving()
                return True
        for name, manifest in list(self.pods.items()):
            if manifest["metadata"]["labels"].get(naming.DRAINING_LABEL) == "true":
                del self.pods[name]
                self.note_serving()
                return True
        return False

    def note_serving(self) -> None:
        self.serving_history.append(sum(1 for i in self.observed().values()
                                        if i.ready and not i.draining))


@pytest.mark.parametrize("surge_fits", [True, False])
def test_reconcile_and_the_world_take_a_replica_through_a_whole_rollout(surge_fits):
    """Reconcile runs twice after every change (it is level-based: the second run must do
    nothing new), then one thing happens in the world. At the end both instances are new,
    exactly two were created, none went without a drain, and with room for a surge at
    least two Ready instances stayed in rotation throughout."""
    cluster = Cluster(pod(0, OLD), pod(1, OLD, incarnation="bbbbb"))
    for _ in range(50):
        cluster.reconcile(NEW, surge_fits)
        cluster.reconcile(NEW, surge_fits)
        if not cluster.world():
            break
    final = cluster.observed()
    assert len(final) == 2 and all(i.ready and not i.draining for i in final.values())
    assert {i.template_hash for i in final.values()} == {builders.template_hash(NEW)}
    assert cluster.created == 2
    assert min(cluster.serving_history) == (2 if surge_fits else 1)


def test_a_surge_instance_takes_the_pool_of_the_instance_it_replaces():
    """Pools full (short 1, long 1): the surge instance would otherwise go to the long
    pool; it replaces r-0 of the short pool, so it is short."""
    pooled_old = spec(pools={"short": 1}, instances=2)
    pooled_new = spec(pools={"short": 1}, instances=2, image="a:2")

    def in_pool(index: int, pool: str, incarnation: str) -> dict:
        manifest = pod(index, pooled_old, incarnation=incarnation)
        manifest["metadata"]["labels"][naming.POOL_LABEL] = pool
        return manifest

    step = plan_step(pooled_new, live(in_pool(0, "short", "aaaaa"), in_pool(1, "long", "bbbbb")),
                     {}, "r", autoscaler_desired=None,
                     template_hash=builders.template_hash(pooled_new), surge_fits=lambda: True)
    assert step.plan.create == ((2, "short"),)
