"""The router children of a ServingReplica with pools: Deployment, ServiceAccount, RoleBinding,
and the client Service that selects the router instead of the agents."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from slipstream.agent.router import cli as router_cli
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, naming, router
from slipstream.operator.kube import _contains, _owned_fields

REPO = Path(__file__).resolve().parents[2]
SPEC = ServingReplicaSpec.model_validate({
    "model": {"name": "llama", "source": {"hostPath": {"path": "/models/llama"}}},
    "image": "agent:1", "instances": 3, "parallelism": {"tp": 2},
    "placement": {"nodeSelector": {"gpu": "h100"}},
    "pools": {"short": 1, "longPrefillThresholdTokens": 4096},
})


def deployment() -> dict:
    return router.build_router_deployment_spec("chat", "ns", SPEC)


def test_router_runs_slipstream_router_on_the_replicas_agents_with_the_pool_threshold():
    container = deployment()["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:2] == ["slipstream", "router"]
    args = dict(zip(command[2::2], command[3::2]))
    assert args == {"--namespace": "ns",
                    "--selector": "slipstream.dev/replica=chat,slipstream.dev/role=controller",
                    "--long-prefill-threshold-tokens": "4096", "--model": "/models/llama",
                    "--host": "$(POD_IP)", "--port": "8000"}
    # The command is one the router's own parser accepts, with the values it means.
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    parsed = parser.parse_args(command[2:])
    assert parsed.long_prefill_threshold_tokens == 4096 and parsed.port == naming.HTTP_PORT
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": naming.HTTP_PORT}]
    assert container["volumeMounts"] == [{"name": builders.MODEL_VOLUME,
                                          "mountPath": "/models/llama", "readOnly": True}]


def test_router_of_fcfs_agents_counts_their_whole_backlog():
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    assert parser.parse_args(deployment()["spec"]["template"]["spec"]["containers"][0][
        "command"][2:]).instance_queue_order == "shorter-first"  # LARS, the default
    fcfs = SPEC.model_copy(update={"scheduler": SPEC.scheduler.model_copy(
        update={"policy": "fcfs"})})
    command = router.build_router_deployment_spec("chat", "ns", fcfs)["spec"]["template"][
        "spec"]["containers"][0]["command"]
    assert parser.parse_args(command[2:]).instance_queue_order == "fifo"


def test_router_pods_are_no_agent_pods_and_run_as_their_own_service_account():
    manifest = deployment()
    template = manifest["spec"]["template"]
    labels = template["metadata"]["labels"]
    # The operator lists agent pods by the replica label: the router must not look like one.
    assert naming.REPLICA_LABEL not in labels
    assert manifest["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert template["spec"]["serviceAccountName"] == "chat-router"
    assert template["spec"]["nodeSelector"] == {"gpu": "h100"}
    # No GPUs: the router must not take capacity the placement counts on.
    requests = template["spec"]["containers"][0]["resources"]["requests"]
    assert SPEC.placement.gpu_resource not in requests


def test_role_binding_grants_the_chart_cluster_role_in_the_namespace_only():
    binding = router.build_router_role_binding_spec("chat", "ns")
    account = router.build_router_service_account_spec("chat", "ns")
    assert binding["kind"] == "RoleBinding" and binding["metadata"]["namespace"] == "ns"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": naming.ROUTER_CLUSTER_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": account["metadata"]["name"], "namespace": "ns"}]


def test_chart_defines_the_router_cluster_role_read_only():
    text = (REPO / "charts/slipstream/templates/rbac.yaml").read_text()
    # Template lines out; what is left of this document is plain YAML.
    documents = [yaml.safe_load("\n".join(line for line in part.splitlines()
                                          if "{{" not in line))
                 for part in text.split("\n---\n")
                 if f"name: {naming.ROUTER_CLUSTER_ROLE}\n" in part]
    assert len(documents) == 1
    role = documents[0]
    assert role["kind"] == "ClusterRole"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]


def test_client_service_selects_the_router_with_pools():
    service = builders.build_client_service_spec("chat", "ns", via_router=True)
    assert service["metadata"]["name"] == "chat"
    assert service["spec"]["selector"] == {naming.ROUTER_LABEL: "chat"}
    assert service["spec"]["selector"].items() <= \
        deployment()["spec"]["template"]["metadata"]["labels"].items()


def test_switching_the_client_service_to_the_router_removes_the_agent_selector_keys():
    agents = builders.build_client_service_spec("chat", "ns")
    routed = builders.build_client_service_spec("chat", "ns", via_router=True)
    current = {**agents, "spec": {**agents["spec"], "clusterIP": "10.0.0.1"}}
    patch = _owned_fields(routed, current)
    assert patch["spec"]["selector"] == {naming.ROUTER_LABEL: "chat",
                                         naming.REPLICA_LABEL: None, naming.ROLE_LABEL: None}
    assert not _contains(current, patch)
    switched = {**current, "spec": {**current["spec"], "selector": routed["spec"]["selector"]}}
    assert _contains(switched, _owned_fields(routed, switched))  # then in place: no patch
