"""The operator's side of autoscaling, without a cluster: draining instances are seen and kept
out of reconcile's plan (their indices held), the count reconcile aims at, the signals the
autoscaler builds, its status, the end of a drain (said once), and the rebalancer holding while
the count changes."""

from __future__ import annotations

import asyncio

from slipstream.crds.replica_status import AutoscalingStatus, ServingReplicaStatus
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.decisions.autoscale import SCALE_DOWN, WITHIN_TARGETS
from slipstream.decisions.scale_signals import InstanceLoad, ScaleDecision, ScaleHistory
from slipstream.operator import builders, naming
from slipstream.operator.handle_autoscale import finish_drains, scale_signals, with_autoscaling
from slipstream.operator.handle_rebalance import every_period, scaling_in_progress
from slipstream.operator.instances import observe_pods, plan_instances, target_count
from slipstream.operator.placement import NodeShare

GPU = "nvidia.com/gpu"


def spec(autoscaling: dict | None = None, instances: int = 2,
         pools: dict | None = None) -> ServingReplicaSpec:
    body: dict = {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}},
                  "image": "a:1", "instances": instances}
    if autoscaling is not None:
        body["autoscaling"] = autoscaling
    if pools is not None:
        body["pools"] = pools
    return ServingReplicaSpec.model_validate(body)


AUTO = spec({"minInstances": 1, "maxInstances": 5})


def agent_pod(index: int, *, ready: bool = True, draining_since: str | None = None,
              pool: str = "unified", deleting: bool = False) -> dict:
    manifest = builders.build_agent_pod_spec(
        "r", "ns", AUTO, instance=naming.instance_name("r", index), index=index,
        incarnation="aaaaa", share=NodeShare(node="node-0", gpus=8, first_rank=0), rank=0,
        num_ranks=1, pool=pool)
    manifest["status"] = {"phase": "Running", "podIP": f"127.0.1.{index}", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if draining_since is not None:
        manifest["metadata"]["labels"][naming.DRAINING_LABEL] = "true"
        manifest["metadata"]["labels"][naming.ROLE_LABEL] = naming.ROLE_DRAINING
        manifest["metadata"].setdefault("annotations", {})[
            naming.DRAINING_SINCE_ANNOTATION] = draining_since
    if deleting:
        manifest["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return manifest


def test_a_draining_instance_is_observed_with_its_start():
    observed = observe_pods([agent_pod(0), agent_pod(1, draining_since="1700000000.5")], GPU)
    assert not observed["r-0"].draining
    assert observed["r-1"].draining and observed["r-1"].draining_since_s == 1700000000.5
    # Marked by hand without a time: treated as long past its bound.
    by_hand = agent_pod(2, draining_since="soon")
    assert observe_pods([by_hand], GPU)["r-2"].draining_since_s == 0.0


def test_the_client_service_no_longer_selects_a_draining_controller():
    selector = builders.build_client_service_spec("r", "ns")["spec"]["selector"]
    draining = agent_pod(1, draining_since="1")["metadata"]["labels"]
    serving = agent_pod(0)["metadata"]["labels"]
    assert all(serving.get(k) == v for k, v in selector.items())
    assert not all(draining.get(k) == v for k, v in selector.items())


def test_reconcile_plans_around_a_draining_instance_without_reusing_its_index():
    everything = observe_pods([agent_pod(0), agent_pod(1, draining_since="1"), agent_pod(2)],
                              GPU)
    live = {k: i for k, i in everything.items() if not i.draining}
    result = plan_instances(AUTO, live, {}, "r", count=3, reserved=frozenset({1}))
    assert [i.name for i in result.keep] == ["r-0", "r-2"]
    assert result.create == ((3, "unified"),)  # index 1 stays with the draining instance
    assert not result.tear_down


def test_a_scale_up_places_its_instances_in_the_pools_the_autoscaler_chose():
    pooled = spec({"minInstances": 2, "maxInstances": 5}, pools={"short": 1})
    live = observe_pods([agent_pod(0, pool="short"), agent_pod(1, pool="long")], GPU)
    # Without a choice a new instance goes to the long pool (short is at spec.pools.short).
    assert plan_instances(pooled, live, {}, "r", count=3).create == ((2, "long"),)
    # The autoscaler chose the short pool (the pressured one): reconcile follows it.
    assert plan_instances(pooled, live, {}, "r", count=3, new_pools=["short"]).create == \
        ((2, "short"),)
    # Two chosen, one already placed (capacity came for one): the last choice is still owed.
    assert plan_instances(pooled, live, {}, "r", count=3, new_pools=["long", "short"]
                          ).create == ((2, "short"),)
    # A pool that does not exist is not followed.
    assert plan_instances(pooled, live, {}, "r", count=3, new_pools=["decode"]).create == \
        ((2, "long"),)


class RecordingKube:
    def __init__(self) -> None:
        self.deleted: list[tuple[str, str]] = []

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.deleted.append((kind, name))


def test_a_finished_drain_is_said_once_while_its_pods_terminate():
    """The pass that finds nothing in flight deletes the pods; the agent's SIGTERM drain keeps
    them terminating for a while, and the passes after it see them deleting (which counts as
    failed): no second InstanceDrained event, and no second delete of the pods."""
    kube, said = RecordingKube(), []
    body = {"metadata": {"name": "r", "namespace": "ns"}}
    def event(_body, _kind, reason, message):
        said.append((reason, message))
    def idle(_instance):
        return (None, 0)
    def passes(*pods):
        finish_drains(kube, body, AUTO, observe_pods(list(pods), GPU), 100.0, idle, event)

    passes(agent_pod(0), agent_pod(1, draining_since="1"))
    assert [reason for reason, _ in said] == ["InstanceDrained"]
    assert "nothing in flight" in said[0][1]
    pods_deleted = sum(kind == "Pod" for kind, _ in kube.deleted)
    assert pods_deleted == 1 and ("Service", "r-1") in kube.deleted, kube.deleted
    for _ in range(3):
        passes(agent_pod(0), agent_pod(1, draining_since="1", deleting=True))
    assert [reason for reason, _ in said] == ["InstanceDrained"]
    assert sum(kind == "Pod" for kind, _ in kube.deleted) == pods_deleted
    # A draining instance whose pod failed (not deleted) is still finished, once.
    passes(agent_pod(0), agent_pod(2, draining_since="1", ready=False) | {
        "status": {"phase": "Failed"}})
    assert said[-1] == ("InstanceDrained", "r-2 removed: its pods had already stopped")


def test_status_keeps_the_chosen_pools_until_the_count_changes_again():
    up = ScaleDecision(current=2, desired=3, recommendation=3, reason="ScaleUp", message="up",
                       history=ScaleHistory(since_s=0.0), add_pools=("short",))
    after_up = with_autoscaling(ServingReplicaStatus(), up, "t1")
    assert after_up.autoscaling is not None and after_up.autoscaling.add_pools == ["short"]
    calm = with_autoscaling(after_up, decision(3, 3, WITHIN_TARGETS), "t2")
    assert calm.autoscaling is not None and calm.autoscaling.add_pools == ["short"]
    down = with_autoscaling(calm, decision(3, 2, SCALE_DOWN), "t3")
    assert down.autoscaling is not None and down.autoscaling.add_pools == []


def test_target_count():
    plain = spec(instances=4)
    assert target_count(plain, desired=7, live=2) == 4  # no autoscaling: spec.instances
    assert target_count(AUTO, desired=None, live=0) == 1  # fresh: minInstances
    assert target_count(AUTO, desired=None, live=9) == 5  # switched on over 9: max
    assert target_count(AUTO, desired=None, live=3) == 3  # switched on: keeps what runs
    assert target_count(AUTO, desired=4, live=2) == 4
    assert target_count(AUTO, desired=0, live=2) == 1  # never below minInstances


def test_signals_read_ready_instances_and_count_the_rest_as_starting():
    observed = observe_pods([agent_pod(0), agent_pod(1, ready=False),
                             agent_pod(2, draining_since="1"), agent_pod(3)], GPU)
    read = {"r-0": InstanceLoad("r-0", prefill_load=0.3)}

    def reader(instance):
        load = read.get(instance.name)
        return None if load is None else (load, 2)

    previous = ServingReplicaStatus(autoscaling=AutoscalingStatus(
        desired_instances=4, current_instances=3))
    signals = scale_signals(observed, previous, reader, "r")
    assert [x.instance for x in signals.loads] == ["r-0"]
    # r-1 is starting, r-3 did not answer; r-2 drains (not counted); one desired is unplaced.
    assert [x.instance for x in signals.starting] == ["r-1", "r-3", "r-unplaced-0"]
    assert signals.current == 4


def decision(current: int, desired: int, reason: str, message: str = "m") -> ScaleDecision:
    return ScaleDecision(current=current, desired=desired, recommendation=desired,
                         reason=reason, message=message, history=ScaleHistory(since_s=0.0))


def test_status_changes_with_the_count_or_the_outcome_not_every_period():
    first = with_autoscaling(ServingReplicaStatus(), decision(3, 2, SCALE_DOWN, "down"), "t1")
    assert first.autoscaling == AutoscalingStatus(
        desired_instances=2, current_instances=3, last_scale_reason=SCALE_DOWN,
        last_scale_message="down", last_scale_time="t1")
    calm = with_autoscaling(first, decision(2, 2, WITHIN_TARGETS, "calm 1"), "t2")
    assert calm.autoscaling is not None
    assert (calm.autoscaling.last_scale_reason, calm.autoscaling.last_scale_time) == \
        (WITHIN_TARGETS, "t1")
    again = with_autoscaling(calm, decision(2, 2, WITHIN_TARGETS, "calm 2"), "t3")
    assert again == calm  # same outcome, new signal values: nothing to write


def test_rebalancer_waits_while_the_autoscaler_changes_the_count():
    pooled = spec({"minInstances": 2, "maxInstances": 5}, pools={"short": 1})
    steady = observe_pods([agent_pod(0), agent_pod(1)], GPU)
    at_two = ServingReplicaStatus(autoscaling=AutoscalingStatus(desired_instances=2,
                                                                current_instances=2))
    assert scaling_in_progress(pooled, at_two, steady) is None
    growing = ServingReplicaStatus(autoscaling=AutoscalingStatus(desired_instances=3,
                                                                 current_instances=2))
    assert "2 -> 3" in (scaling_in_progress(pooled, growing, steady) or "")
    draining = observe_pods([agent_pod(0), agent_pod(1), agent_pod(2, draining_since="1")], GPU)
    assert "draining" in (scaling_in_progress(pooled, at_two, draining) or "")
    assert scaling_in_progress(spec(pools={"short": 1}), growing, steady) is None


class _StopAfter:
    """kopf's DaemonStopped stand-in: stopped once ``wait`` has been called ``waits`` times."""

    def __init__(self, waits: int) -> None:
        self.left = waits

    async def wait(self, timeout: float | None = None) -> None:
        self.left -= 1

    def __bool__(self) -> bool:
        return self.left < 0


def test_a_daemon_loop_outlives_a_failed_step_and_stops_when_told():
    calls: list[int] = []
    warnings: list[str] = []

    async def step() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("api server away")

    class Log:
        def warning(self, message: str) -> None:
            warnings.append(message)

    asyncio.run(every_period(_StopAfter(3), lambda: 0.0, step, "autoscale", Log()))
    assert calls == [0, 1, 2]  # three periods, the first step failed, the loop went on
    assert warnings == ["autoscale step failed: RuntimeError('api server away')"]
