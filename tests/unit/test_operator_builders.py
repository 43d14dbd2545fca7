"""Child manifests from the pure builders: agent pods, headless and client Services, ConfigMap."""

from __future__ import annotations

from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, naming
from slipstream.operator.placement import NodeShare

SPEC = ServingReplicaSpec.model_validate({
    "model": {"name": "llama", "source": {"hostPath": {"path": "/models/llama"}},
              "maxModelLen": 8192},
    "image": "agent:1",
    "instances": 2,
    "parallelism": {"tp": 4, "spp": 2},
    "placement": {"nodeSelector": {"gpu": "h100"},
                  "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "pools": {"short": 1, "longPrefillThresholdTokens": 4096},
    "slo": {"ttftSeconds": 0.5, "tpotMilliseconds": 40},
})


def pod(rank: int = 0, share: NodeShare | None = None, spec: ServingReplicaSpec = SPEC) -> dict:
    share = share or NodeShare(node="node-a", gpus=4, first_rank=4 * rank)
    return builders.build_agent_pod_spec("chat", "ns", spec, instance="chat-1", index=1,
                                         incarnation="abcde", share=share, rank=rank,
                                         num_ranks=2, pool="short")


def env(manifest: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in
            manifest["spec"]["containers"][0]["env"]}


def test_rank0_pod_serves_the_mounted_config_on_its_pod_ip():
    """The spec's engine settings travel in the ConfigMap (test_agent_config.py follows them
    to the engine); the command carries only the config path and the pod's ports."""
    manifest = pod(0)
    container = manifest["spec"]["containers"][0]
    assert container["command"] == [
        "slipstream", "serve", "--config", f"{builders.CONFIG_MOUNT_DIR}/engine.yaml",
        "--port", str(naming.HTTP_PORT), "--control-port", str(naming.CONTROL_PORT),
        "--no-profile"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts[builders.CONFIG_VOLUME]["mountPath"] == builders.CONFIG_MOUNT_DIR
    volumes = {v["name"]: v for v in manifest["spec"]["volumes"]}
    assert volumes[builders.CONFIG_VOLUME]["configMap"] == {"name": naming.config_map_name("chat")}
    assert env(manifest)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env(manifest)["SLIPSTREAM_POOL"] == {
        "fieldRef": {"fieldPath": f"metadata.labels['{naming.POOL_LABEL}']"}}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_pod_is_pinned_to_its_node_and_requests_its_gpus():
    manifest = pod(1, NodeShare(node="node-b", gpus=4, first_rank=4))
    terms = manifest["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                       "values": ["node-b"]}]}]
    resources = manifest["spec"]["containers"][0]["resources"]
    assert resources["requests"] == {"nvidia.com/gpu": "4"} == resources["limits"]
    assert manifest["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert manifest["spec"]["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert manifest["spec"]["restartPolicy"] == "Never"


def test_multi_node_instance_tells_each_pod_its_ranks_and_the_controller():
    worker = env(pod(1, NodeShare(node="node-b", gpus=4, first_rank=4)))
    assert worker["SLIPSTREAM_WORLD_SIZE"] == "8"
    assert worker["SLIPSTREAM_NODE_RANKS"] == "4-7"
    assert worker["SLIPSTREAM_CONTROLLER_ADDR"] == \
        f"rank-0.chat-1.ns.svc:{naming.PARALLEL_CONTROLLER_PORT}"
    assert worker["MASTER_ADDR"] == "rank-0.chat-1.ns.svc"
    assert env(pod(0))["SLIPSTREAM_NODE_RANKS"] == "0-3"
    manifest = pod(0)
    assert (manifest["spec"]["hostname"], manifest["spec"]["subdomain"]) == ("rank-0", "chat-1")


def test_single_pod_instance_launches_every_rank_itself():
    manifest = builders.build_agent_pod_spec(
        "chat", "ns", SPEC, instance="chat-0", index=0, incarnation="abcde",
        share=NodeShare(node="node-a", gpus=8, first_rank=0), rank=0, num_ranks=1,
        pool="short")
    variables = env(manifest)
    assert variables["SLIPSTREAM_WORLD_SIZE"] == "8"
    assert "SLIPSTREAM_CONTROLLER_ADDR" not in variables


def test_worker_rank_runs_a_worker_without_http_probes():
    container = pod(1)["spec"]["containers"][0]
    assert container["command"] == ["slipstream", "worker"]
    assert "readinessProbe" not in container


def test_pod_labels_let_the_operator_find_its_pieces():
    labels = pod(0)["metadata"]["labels"]
    assert labels[naming.REPLICA_LABEL] == "chat"
    assert labels[naming.INSTANCE_LABEL] == "chat-1"
    assert labels[naming.INSTANCE_INDEX_LABEL] == "1"
    assert labels[naming.RANK_LABEL] == "0"
    assert labels[naming.NUM_RANKS_LABEL] == "2"
    assert labels[naming.ROLE_LABEL] == naming.ROLE_CONTROLLER
    assert labels[naming.POOL_LABEL] == "short"
    assert pod(0)["metadata"]["name"] == "chat-1-abcde-0"


def test_pvc_model_source_mounts_the_claim_and_points_into_it():
    spec = SPEC.model_copy(update={"model": SPEC.model.model_copy(update={
        "source": ServingReplicaSpec.model_validate({
            "model": {"name": "m", "source": {"pvc": {"claimName": "models",
                                                      "subPath": "llama/"}}},
            "image": "x"}).model.source})})
    manifest = pod(0, spec=spec)
    assert builders.agent_config(spec).model.path == "/models/llama"
    volumes = {v["name"]: v for v in manifest["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_headless_service_publishes_not_ready_ranks():
    service = builders.build_instance_service_spec("chat", "ns", "chat-1")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {naming.INSTANCE_LABEL: "chat-1"}


def test_client_services_select_controllers_and_pools_by_label():
    everyone = builders.build_client_service_spec("chat", "ns")
    short = builders.build_client_service_spec("chat", "ns", "short")
    assert everyone["metadata"]["name"] == "chat" and short["metadata"]["name"] == "chat-short"
    assert everyone["spec"]["selector"] == {naming.REPLICA_LABEL: "chat",
                                            naming.ROLE_LABEL: naming.ROLE_CONTROLLER}
    assert short["spec"]["selector"][naming.POOL_LABEL] == "short"


def test_long_names_are_shortened_to_dns_labels_without_collisions():
    first = naming.instance_name("x" * 70, 1)
    second = naming.instance_name("x" * 70, 2)
    assert len(first) <= 63 and len(second) <= 63 and first != second


def test_pod_commands_parse_with_the_agents_own_argument_parsers():
    """The operator writes command lines for `slipstream serve`/`worker`: they must stay in
    step with those CLIs."""
    import argparse

    from slipstream.agent.parallel import launch
    from slipstream.agent.server import cli_flags

    serve = argparse.ArgumentParser(exit_on_error=False)
    cli_flags.add_arguments(serve)
    args = serve.parse_args(pod(0)["spec"]["containers"][0]["command"][2:])
    assert vars(args)["server.control_port"] == naming.CONTROL_PORT
    worker = argparse.ArgumentParser(exit_on_error=False)
    launch.add_arguments(worker)
    worker.parse_args(pod(1)["spec"]["containers"][0]["command"][2:])


def test_kv_tiers_reach_the_agent_config_and_mount_the_disk_tier():
    tiered = ServingReplicaSpec.model_validate({
        "model": {"name": "llama", "source": {"hostPath": {"path": "/models/llama"}}},
        "image": "agent:1", "instances": 1, "parallelism": {"tp": 1},
        "kvTiers": {"hostMemory": "1TiB", "diskPath": "/var/cache/kv", "diskSize": "2TiB"},
    })
    manifest = pod(spec=tiered, share=NodeShare(node="node-a", gpus=1, first_rank=0))
    volumes = {v["name"]: v for v in manifest["spec"]["volumes"]}
    assert volumes[builders.KV_DISK_VOLUME] == {"emptyDir": {"sizeLimit": "2Ti"},
                                                "name": builders.KV_DISK_VOLUME}
    mounts = {m["name"]: m for m in manifest["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[builders.KV_DISK_VOLUME]["mountPath"] == "/var/cache/kv"
    config = builders.agent_config(tiered).to_tree(only_set=True)
    assert config["kvTiers"] == {"hostMemory": "1TiB", "diskPath": "/var/cache/kv",
                                 "diskSize": "2TiB"}
    assert builders.kubernetes_quantity("500GB") == "500G"
    # Without the field nothing about the pod changes.
    assert builders.KV_DISK_VOLUME not in {v["name"] for v in pod()["spec"]["volumes"]}
