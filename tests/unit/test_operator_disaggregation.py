"""The operator's side of prefill/decode disaggregation: which instances get which role
(pools, scaling, recovery), what their pods run, the router it adds, and the status."""

from __future__ import annotations

import argparse

from slipstream.agent.router import cli as router_cli
from slipstream.crds.replica_status import ServingReplicaStatus
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, naming, router
from slipstream.operator.instances import observe_pods, plan_instances, target_count
from slipstream.operator.placement import InstancePlacement, NodeShare
from slipstream.operator.status import CreatedInstance, build_status

GPU = "nvidia.com/gpu"
NOW = "2026-01-01T00:00:00Z"


def spec(prefill: int = 1, decode: int = 2, pools: dict | None = None) -> ServingReplicaSpec:
    body = {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "a:1",
            "instances": 7,  # ignored while disaggregated
            "disaggregation": {"prefill": {"instances": prefill},
                               "decode": {"instances": decode}}}
    if pools is not None:
        body["pools"] = pools
    return ServingReplicaSpec.model_validate(body)


def agent_pod(the_spec: ServingReplicaSpec, index: int, pool: str, *, phase: str = "Running",
              ready: bool = True) -> dict:
    manifest = builders.build_agent_pod_spec(
        "r", "ns", the_spec, instance=naming.instance_name("r", index), index=index,
        incarnation="aaaaa", share=NodeShare(node=f"node-{index}", gpus=1, first_rank=0),
        rank=0, num_ranks=1, pool=pool)
    manifest["spec"]["nodeName"] = f"node-{index}"
    manifest["status"] = {"phase": phase, "podIP": f"127.0.1.{index}", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}
    return manifest


def plan(the_spec, pods, remembered=None):
    return plan_instances(the_spec, observe_pods(pods, GPU), remembered or {}, "r",
                          count=target_count(the_spec, None, len(pods)))


def test_the_roles_counts_replace_spec_instances():
    assert target_count(spec(1, 2), None, 0) == 3
    result = plan(spec(1, 2), [])
    assert result.create == ((0, "unified"), (1, "decode"), (2, "decode"))


def test_prefill_instances_split_into_pools_and_decode_instances_stay_apart():
    result = plan(spec(3, 2, pools={"short": 1, "rebalance": {"minPerPool": 1}}), [])
    assert [pool for _, pool in result.create] == ["short", "long", "long", "decode", "decode"]


def test_a_changed_ratio_replaces_instances_of_the_role_that_shrank():
    old = spec(2, 1)
    pods = [agent_pod(old, 0, "unified"), agent_pod(old, 1, "unified"),
            agent_pod(old, 2, "decode")]
    result = plan(spec(1, 2), pods)  # the same 3 instances, one more decode
    assert [i.name for i in result.tear_down] == ["r-1"]
    assert result.create == ((1, "decode"),)
    assert sorted(i.name for i in result.keep) == ["r-0", "r-2"]


def test_a_failed_decode_instance_comes_back_as_a_decode_instance():
    the_spec = spec(1, 2)
    pods = [agent_pod(the_spec, 0, "unified"), agent_pod(the_spec, 1, "decode"),
            agent_pod(the_spec, 2, "decode", phase="Failed")]
    result = plan(the_spec, pods)
    assert result.restarts == ("r-2",) and result.create == ((2, "decode"),)


def test_a_remembered_pool_does_not_overfill_its_role():
    # r-1 was a decode instance under an older ratio; now decode is full.
    the_spec = spec(2, 1)
    pods = [agent_pod(the_spec, 0, "unified"), agent_pod(the_spec, 2, "decode")]
    result = plan(the_spec, pods, remembered={"r-1": "decode"})
    assert result.create == ((1, "unified"),)


def test_each_role_runs_serve_with_its_role_and_prefill_declares_its_side_channel():
    the_spec = spec()
    prefill = agent_pod(the_spec, 0, "unified")["spec"]["containers"][0]
    decode = agent_pod(the_spec, 1, "decode")["spec"]["containers"][0]
    for container, role in ((prefill, "prefill"), (decode, "decode")):
        command = container["command"]
        assert command[command.index("--role") + 1] == role
    assert prefill["command"][prefill["command"].index("--kv-side-channel-port") + 1] == \
        str(naming.KV_SIDE_CHANNEL_PORT)
    assert {"name": "kv-side", "containerPort": naming.KV_SIDE_CHANNEL_PORT} in prefill["ports"]
    assert "--kv-side-channel-port" not in decode["command"]
    assert all(port["name"] != "kv-side" for port in decode["ports"])
    # A mixed replica's pods name no role (the agent's default, mixed).
    mixed = ServingReplicaSpec.model_validate(
        {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "a:1"})
    assert "--role" not in agent_pod(mixed, 0, "unified")["spec"]["containers"][0]["command"]


def test_a_disaggregated_replica_gets_a_router_without_pool_flags():
    the_spec = spec()
    assert router.wants_router(the_spec)
    command = router.build_router_deployment_spec("r", "ns", the_spec)[
        "spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--long-prefill-threshold-tokens" not in command
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    parsed = parser.parse_args(command[2:])
    # The router watches every rank-0 agent pod: prefill ones and those labelled decode.
    assert parsed.selector == router.agent_selector("r")


def created(index: int, pool: str) -> CreatedInstance:
    name = naming.instance_name("r", index)
    return CreatedInstance(name=name, pool=pool, placement=InstancePlacement(
        (NodeShare(node=f"node-{index}", gpus=1, first_rank=0),)),
        pod_names=(f"{name}-bbbbb-0",))


def test_status_counts_each_role_and_names_each_instances_role():
    the_spec = spec(1, 2)
    observed = observe_pods([agent_pod(the_spec, 0, "unified"),
                             agent_pod(the_spec, 1, "decode", ready=False)], GPU)
    result = build_status(replica="r", namespace="ns", spec=the_spec, generation=1,
                          kept=list(observed.values()), created=[created(2, "decode")],
                          failure=None, previous=ServingReplicaStatus(), now=NOW)
    assert result.ready == "1/3" and result.phase == "Progressing"
    assert result.disaggregation is not None
    assert (result.disaggregation.prefill.ready, result.disaggregation.decode.ready) == \
        ("1/1", "0/2")
    assert result.disaggregation.decode.instances == 2
    assert [(i.name, i.role) for i in result.instances] == \
        [("r-0", "prefill"), ("r-1", "decode"), ("r-2", "decode")]
    wire = result.model_dump(mode="json", by_alias=True)
    assert wire["disaggregation"]["prefill"]["readyInstances"] == 1


def test_a_rolling_update_surges_one_instance_in_the_role_it_replaces():
    from slipstream.operator.instances import plan_step

    old = spec(1, 1)
    new = ServingReplicaSpec.model_validate({**old.to_api(), "image": "a:2"})
    pods = [agent_pod(old, 0, "unified"), agent_pod(old, 1, "decode")]
    step = plan_step(new, observe_pods(pods, GPU), {}, "r", autoscaler_desired=None,
                     template_hash=builders.template_hash(new), surge_fits=lambda: True)
    # One instance more than the roles' sum, in the role of the first outdated instance.
    assert step.rollout.count == 3 and step.plan.create == ((2, "unified"),)
    assert step.plan.tear_down == ()
    # While it starts it keeps its slot beyond the prefill count.
    pods.append(agent_pod(new, 2, "unified", ready=False))
    step = plan_step(new, observe_pods(pods, GPU), {}, "r", autoscaler_desired=None,
                     template_hash=builders.template_hash(new), surge_fits=lambda: True)
    assert step.rollout.count == 3 and step.rollout.drain is None
    assert step.plan.tear_down == () and step.plan.create == ()
    # Once Ready, the outdated prefill instance it replaces is drained.
    pods[-1] = agent_pod(new, 2, "unified")
    step = plan_step(new, observe_pods(pods, GPU), {}, "r", autoscaler_desired=None,
                     template_hash=builders.template_hash(new), surge_fits=lambda: True)
    assert step.rollout.drain is not None and step.rollout.drain.name == "r-0"
    assert step.plan.tear_down == () and step.plan.create == ()
    assert sorted(i.name for i in step.plan.keep) == ["r-1", "r-2"]


def test_dropping_disaggregation_rolls_decode_instances_back_to_mixed_ones():
    from slipstream.operator.instances import plan_step

    old = spec(1, 1)
    mixed = ServingReplicaSpec.model_validate(
        {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "a:1",
         "instances": 2})
    # The prefill instance was replaced already; the decode instance is next.
    pods = [agent_pod(old, 1, "decode"), agent_pod(mixed, 2, "unified")]
    step = plan_step(mixed, observe_pods(pods, GPU), {}, "r", autoscaler_desired=None,
                     template_hash=builders.template_hash(mixed), surge_fits=lambda: True)
    assert step.rollout.outdated == ("r-1",) and step.rollout.count == 3
    # Its replacement is an ordinary instance, not one labelled decode.
    assert step.plan.create == ((0, "unified"),)
