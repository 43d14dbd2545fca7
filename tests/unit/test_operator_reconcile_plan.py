"""The pure core of reconcile: observing pods, planning instances (recreate, scale, pools) and
computing the status (conditions, phase, printer-column fields, rebalance results)."""

from __future__ import annotations

from slipstream.crds.replica_status import ServingReplicaStatus
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, naming
from slipstream.operator.instances import observe_pods, plan_instances
from slipstream.operator.placement import InstancePlacement, NodeShare, PlacementFailure
from slipstream.decisions.pools import MOVED, Move, RebalanceDecision
from slipstream.operator.status import CreatedInstance, build_status, with_rebalance

GPU = "nvidia.com/gpu"
NOW = "2026-01-01T00:00:00Z"


def spec(instances: int = 2, pools: dict | None = None, tp: int = 8) -> ServingReplicaSpec:
    body = {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "a:1",
            "instances": instances, "parallelism": {"tp": tp}}
    if pools is not None:
        body["pools"] = pools
    return ServingReplicaSpec.model_validate(body)


def agent_pod(index: int, *, rank: int = 0, num_ranks: int = 1, pool: str = "unified",
              phase: str = "Running", ready: bool = True, incarnation: str = "aaaaa",
              deleting: bool = False) -> dict:
    manifest = builders.build_agent_pod_spec(
        "r", "ns", spec(), instance=naming.instance_name("r", index), index=index,
        incarnation=incarnation, share=NodeShare(node=f"node-{index}", gpus=8, first_rank=0),
        rank=rank, num_ranks=num_ranks, pool=pool)
    manifest["spec"]["nodeName"] = f"node-{index}"
    manifest["status"] = {"phase": phase, "podIP": f"127.0.1.{index}", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if deleting:
        manifest["metadata"]["deletionTimestamp"] = NOW
    return manifest


def plan(the_spec, pods, remembered=None):
    return plan_instances(the_spec, observe_pods(pods, GPU), remembered or {}, "r")


def test_observe_groups_pods_into_instances_and_reads_their_state():
    observed = observe_pods([agent_pod(0), agent_pod(1, ready=False),
                             {"metadata": {"name": "stranger", "labels": {}}}], GPU)
    assert set(observed) == {"r-0", "r-1"}
    assert observed["r-0"].ready and not observed["r-1"].ready
    assert observed["r-0"].pods[0].gpus == 8 and observed["r-0"].pods[0].ip == "127.0.1.0"


def test_fresh_replica_creates_every_instance():
    result = plan(spec(2), [])
    assert result.create == ((0, "unified"), (1, "unified"))
    assert not result.keep and not result.tear_down and not result.restarts


def test_healthy_instances_are_left_alone():
    result = plan(spec(2), [agent_pod(0), agent_pod(1, ready=False)])
    assert [i.name for i in result.keep] == ["r-0", "r-1"]
    assert result.create == () and result.tear_down == ()


def test_a_failed_pod_recreates_its_whole_instance_in_the_same_pool():
    pods = [agent_pod(0, pool="short"), agent_pod(1, rank=0, num_ranks=2, pool="long"),
            agent_pod(1, rank=1, num_ranks=2, pool="long", phase="Failed")]
    result = plan(spec(2, pools={"short": 1}), pods)
    assert result.restarts == ("r-1",)
    assert [p.name for p in result.tear_down[0].pods] == ["r-1-aaaaa-0", "r-1-aaaaa-1"]
    assert result.create == ((1, "long"),)


def test_a_missing_rank_or_a_deleted_pod_counts_as_failed():
    missing = plan(spec(1), [agent_pod(0, rank=0, num_ranks=2)])
    deleting = plan(spec(1), [agent_pod(0, deleting=True)])
    assert missing.restarts == ("r-0",) and deleting.restarts == ("r-0",)


def test_instance_whose_pods_are_gone_returns_to_its_remembered_pool():
    result = plan(spec(2, pools={"short": 1}), [agent_pod(0, pool="long")],
                  remembered={"r-1": "short"})
    assert result.create == ((1, "short"),)


def test_scale_up_fills_the_lowest_free_indices():
    result = plan(spec(3), [agent_pod(0), agent_pod(2)])
    assert result.create == ((1, "unified"),)


def test_scale_down_removes_failed_then_highest_instances():
    result = plan(spec(1), [agent_pod(0), agent_pod(1), agent_pod(2)])
    assert sorted(i.name for i in result.tear_down) == ["r-1", "r-2"]
    failed_first = plan(spec(2), [agent_pod(0, phase="Failed"), agent_pod(1), agent_pod(2)])
    assert [i.name for i in failed_first.tear_down] == ["r-0"]
    assert failed_first.restarts == () and failed_first.create == ()


def test_scale_down_keeps_min_per_pool():
    # Short pool grew to 3 by rebalancing; scaling 4 -> 3 must not empty the long pool.
    pods = [agent_pod(0, pool="short"), agent_pod(1, pool="short"), agent_pod(2, pool="short"),
            agent_pod(3, pool="long")]
    result = plan(spec(3, pools={"short": 2}), pods)
    assert [i.name for i in result.tear_down] == ["r-2"]


def test_new_instances_fill_the_short_pool_first_then_long():
    result = plan(spec(4, pools={"short": 2}), [])
    assert [pool for _, pool in result.create] == ["short", "short", "long", "long"]


# -- status -------------------------------------------------------------------------------------

def created(index: int, pool: str = "unified") -> CreatedInstance:
    name = naming.instance_name("r", index)
    return CreatedInstance(name=name, pool=pool, placement=InstancePlacement(
        (NodeShare(node=f"node-{index}", gpus=8, first_rank=0),)),
        pod_names=(f"{name}-bbbbb-0",))


def status(the_spec, kept, new, failure=None, previous=None) -> ServingReplicaStatus:
    return build_status(replica="r", namespace="ns", spec=the_spec, generation=3, kept=kept,
                        created=new, failure=failure,
                        previous=previous or ServingReplicaStatus(), now=NOW)


def conditions(result: ServingReplicaStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in result.conditions}


def test_status_of_a_fresh_rollout_is_progressing():
    result = status(spec(2), [], [created(0), created(1)])
    assert result.phase == "Progressing" and result.ready == "0/2" and result.replicas == 2
    assert conditions(result)["Placed"] == ("True", "AllInstancesPlaced")
    assert conditions(result)["Ready"][0] == "False"
    assert conditions(result)["Degraded"][0] == "False"
    assert result.instances[1].ranks[0].node == "node-1"
    assert result.endpoint == "http://r.ns.svc:8000/v1"
    assert result.selector == "slipstream.dev/replica=r"
    assert result.observed_generation == 3


def test_status_ready_when_every_instance_is_ready():
    kept = list(observe_pods([agent_pod(0), agent_pod(1)], GPU).values())
    result = status(spec(2), kept, [])
    assert result.phase == "Ready" and result.ready == "2/2" and result.ready_instances == 2
    assert conditions(result)["Ready"] == ("True", "AllInstancesReady")


def test_unplaceable_instance_sets_placed_false_with_the_reason():
    failure = PlacementFailure("InsufficientGPUs", "needs 8 GPUs")
    nothing = status(spec(1), [], [], failure)
    assert nothing.phase == "Pending"
    assert conditions(nothing)["Placed"] == ("False", "InsufficientGPUs")
    assert "needs 8 GPUs" in nothing.conditions[0].message
    kept = list(observe_pods([agent_pod(0)], GPU).values())
    partial = status(spec(2), kept, [], failure)
    assert partial.phase == "Degraded"
    assert conditions(partial)["Degraded"] == ("True", "PartiallyPlaced")


def test_losing_an_instance_after_ready_is_degraded_and_transition_times_hold():
    kept = list(observe_pods([agent_pod(0), agent_pod(1)], GPU).values())
    ready = status(spec(2), kept, [])
    recovering = build_status(replica="r", namespace="ns", spec=spec(2), generation=3,
                              kept=kept[:1], created=[created(1)], failure=None,
                              previous=ready, now="2026-01-01T00:05:00Z")
    assert recovering.phase == "Degraded"
    assert conditions(recovering)["Degraded"] == ("True", "InstancesRecovering")
    times = {c.type: c.last_transition_time for c in recovering.conditions}
    assert times["Placed"] == NOW, "Placed stayed True: its transition time is kept"
    assert times["Ready"] == "2026-01-01T00:05:00Z"


def test_pool_counts_and_rebalance_results_in_status():
    kept = list(observe_pods([agent_pod(0, pool="short"), agent_pod(1, pool="long"),
                              agent_pod(2, pool="long")], GPU).values())
    before = status(spec(3, pools={"short": 1}), kept, [])
    assert (before.pools.short, before.pools.long) == (1, 2)
    move = RebalanceDecision(MOVED, "short is hot", 3.0, 0.5,
                             move=Move(instance="r-2", from_pool="long", to_pool="short"))
    after = with_rebalance(before, move, "2026-01-01T00:10:00Z", generation=3)
    assert (after.pools.short, after.pools.long) == (2, 1)
    assert after.pools.last_rebalance_time == "2026-01-01T00:10:00Z"
    assert after.pools.pressure.short == 3.0
    assert next(i for i in after.instances if i.name == "r-2").pool == "short"
    balanced = next(c for c in after.conditions if c.type == "PoolsBalanced")
    assert (balanced.status, balanced.reason) == ("False", MOVED)
    assert "moved r-2 from long to short" in balanced.message
    # A later reconcile carries the rebalancer's fields over.
    carried = status(spec(3, pools={"short": 1}), kept, [], previous=after)
    assert carried.pools.last_rebalance_time == "2026-01-01T00:10:00Z"
    assert any(c.type == "PoolsBalanced" for c in carried.conditions)
