"""The operator's side of the closed control plane (issue 30): per-replica control tokens
derived from the master key, the Secret that carries one, the rank-0 agent that requires it,
every call that presents it, and the pods' hardened security contexts."""

from __future__ import annotations

import pytest

from slipstream.contracts.control_auth import derive_control_token
from slipstream.operator import (agent_client, builders, handle_reconcile, naming, pod_security,
                                 router)
from slipstream.operator.control_credentials import ControlCredentials
from slipstream.operator.placement import NodeShare

from tests.unit.test_operator_builders import SPEC

MASTER = b"m" * 40


def agent_pod(rank: int, control_auth: bool) -> dict:
    return builders.build_agent_pod_spec(
        "chat", "ns", SPEC, instance="chat-1", index=1, incarnation="abcde",
        share=NodeShare(node="node-a", gpus=4, first_rank=4 * rank), rank=rank, num_ranks=2,
        pool="short", control_auth=control_auth)


def test_credentials_derive_one_token_per_replica_or_none_without_a_master_key(tmp_path):
    key_file = tmp_path / "master"
    key_file.write_bytes(MASTER + b"\n")
    control = ControlCredentials.from_file(key_file)
    assert control.enabled
    assert control.token("ns", "chat") == derive_control_token(MASTER, "ns", "chat")
    assert control.token("ns", "chat") != control.token("ns", "other")
    assert ControlCredentials.from_file(None).token("ns", "chat") is None
    key_file.write_bytes(b"short")
    with pytest.raises(ValueError, match="shorter"):
        ControlCredentials.from_file(key_file)


def test_the_control_secret_holds_the_token_and_nothing_else():
    secret = builders.build_control_secret_spec("chat", "ns", "t" * 64)
    assert secret["kind"] == "Secret" and secret["type"] == "Opaque"
    assert secret["metadata"]["name"] == naming.control_secret_name("chat") == "chat-control"
    assert secret["stringData"] == {builders.CONTROL_TOKEN_KEY: "t" * 64}


def test_the_controller_requires_the_token_and_workers_do_not_mount_it():
    controller, worker = agent_pod(0, True), agent_pod(1, True)
    container = controller["spec"]["containers"][0]
    token_path = f"{builders.CONTROL_TOKEN_DIR}/{builders.CONTROL_TOKEN_KEY}"
    assert container["command"][container["command"].index("--control-token-file") + 1] \
        == token_path
    volumes = {v["name"]: v for v in controller["spec"]["volumes"]}
    assert volumes[builders.CONTROL_TOKEN_VOLUME]["secret"]["secretName"] == "chat-control"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts[builders.CONTROL_TOKEN_VOLUME] == {
        "name": builders.CONTROL_TOKEN_VOLUME, "mountPath": builders.CONTROL_TOKEN_DIR,
        "readOnly": True}
    assert builders.CONTROL_TOKEN_VOLUME not in {v["name"] for v in worker["spec"]["volumes"]}
    open_pod = agent_pod(0, False)["spec"]["containers"][0]
    assert "--control-token-file" not in open_pod["command"]


@pytest.mark.parametrize("manifest", [
    agent_pod(0, True)["spec"], agent_pod(1, False)["spec"],
    router.build_router_deployment_spec("chat", "ns", SPEC)["spec"]["template"]["spec"]])
def test_every_pod_is_non_root_read_only_without_capabilities(manifest):
    assert manifest["securityContext"]["runAsNonRoot"] is True
    assert manifest["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in manifest["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert context["allowPrivilegeEscalation"] is False


def test_agents_write_only_to_their_scratch_volume():
    spec = agent_pod(0, False)["spec"]
    assert {"name": pod_security.SCRATCH_VOLUME, "emptyDir": {}} in spec["volumes"]
    container = spec["containers"][0]
    assert {"name": pod_security.SCRATCH_VOLUME, "mountPath": "/tmp"} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HOME"].startswith("/tmp/") and env["XDG_CACHE_HOME"].startswith("/tmp/")


def test_the_operator_presents_the_token_on_every_control_call(monkeypatch):
    import grpc

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    seen: list[str | None] = []

    class Client:
        def __init__(self, target: str, timeout_s: float = 2.0, token: str | None = None):
            seen.append(token)

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return None

        def stats(self):
            raise Refused()

        def set_pool(self, pool):
            raise Refused()

    class Controller:
        ip = "10.0.0.7"

    class Instance:
        name, pool, controller = "chat-1", "short", Controller()

    monkeypatch.setattr(agent_client, "ControlClient", Client)
    instance = Instance()
    assert agent_client.read_signals(instance, token="tok") is None  # type: ignore[arg-type]
    assert agent_client.read_load(instance, token="tok") is None  # type: ignore[arg-type]
    assert agent_client.notify_pool(instance, "long", token="tok") is False  # type: ignore
    assert seen == ["tok", "tok", "tok"]


class _FakeKube:
    """Just enough of the API for one reconcile of a new replica on one GPU node."""

    def __init__(self, body: dict) -> None:
        self.body = body
        self.created: list[dict] = []

    def get_replica(self, namespace: str, name: str) -> dict:
        return self.body

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        return []

    def list_active_pods_everywhere(self) -> list[dict]:
        return []

    def list_nodes(self) -> list[dict]:
        return [{"metadata": {"name": "node-a", "labels": {"gpu": "h100"}},
                 "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "8"},
                                        "conditions": [{"type": "Ready", "status": "True"}]}}]

    def ensure(self, manifest: dict) -> None:
        pass

    def create(self, manifest: dict) -> bool:
        self.created.append(manifest)
        return True

    def patch_replica_status(self, namespace: str, name: str, status: dict) -> None:
        pass


def test_reconcile_writes_the_token_secret_and_pods_that_require_it():
    spec = SPEC.model_dump(mode="json", by_alias=True)
    spec.update(instances=1, pools=None, placement={"gpusPerNode": 8})
    spec["parallelism"] = {"tp": 1}
    kube = _FakeKube({"metadata": {"name": "chat", "namespace": "ns", "generation": 1},
                      "spec": spec})
    control = ControlCredentials(MASTER)
    handle_reconcile.reconcile(kube, "ns", "chat",  # type: ignore[arg-type]
                               adopt=lambda child, owner: None, event=lambda *args: None,
                               control=control)
    secrets = [m for m in kube.created if m["kind"] == "Secret"]
    assert [s["stringData"]["token"] for s in secrets] == [control.token("ns", "chat")]
    (pod_manifest,) = [m for m in kube.created if m["kind"] == "Pod"]
    assert "--control-token-file" in pod_manifest["spec"]["containers"][0]["command"]


def test_spec_tenants_mounts_the_secret_and_turns_keys_on_in_agents_and_router():
    spec = SPEC.model_copy(update={"tenants": SPEC.model_validate(
        {**SPEC.to_api(), "tenants": {"secretName": "chat-tenants"}}).tenants})
    controller = builders.build_agent_pod_spec(
        "chat", "ns", spec, instance="chat-1", index=1, incarnation="abcde",
        share=NodeShare(node="node-a", gpus=4, first_rank=0), rank=0, num_ranks=2,
        pool="short")
    tenants_file = f"{builders.TENANTS_DIR}/{builders.TENANTS_KEY}"
    command = controller["spec"]["containers"][0]["command"]
    assert command[command.index("--tenants") + 1] == tenants_file
    volumes = {v["name"]: v for v in controller["spec"]["volumes"]}
    assert volumes[builders.TENANTS_VOLUME]["secret"]["secretName"] == "chat-tenants"
    deployment = router.build_router_deployment_spec("chat", "ns", spec)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][container["command"].index("--tenants") + 1] == tenants_file
    assert {"name": builders.TENANTS_VOLUME, "mountPath": builders.TENANTS_DIR,
            "readOnly": True} in container["volumeMounts"]
    assert builders.template_hash(spec) != builders.template_hash(SPEC)
    assert "--tenants" not in agent_pod(0, False)["spec"]["containers"][0]["command"]
