"""The local control plane is real: version, scheduling, process runtime, probes, GC, helm.

Each test uses its own namespace so they stay independent inside the one session cluster.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import urllib.request
import uuid

import pytest

pytestmark = pytest.mark.e2e

EXPECTED_SERVER_VERSION = "v1.37.1"


@pytest.fixture
def namespace(dev_cluster) -> str:
    name = f"smoke-{uuid.uuid4().hex[:8]}"
    dev_cluster.create_namespace(name)
    yield name
    dev_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pod_manifest(name: str, namespace: str, gpus: int, command: list[str],
                 node: str | None = None, **container_extra) -> dict:
    container = {
        "name": "main",
        "image": "local/process",
        "command": command,
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        **container_extra,
    }
    spec: dict = {"containers": [container], "terminationGracePeriodSeconds": 5}
    if node is not None:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
            "spec": spec}


def get_pod(dev_cluster, namespace: str, name: str) -> dict | None:
    return dev_cluster.api.get(f"/api/v1/namespaces/{namespace}/pods/{name}", ok_missing=True)


def is_ready(pod: dict | None) -> bool:
    return bool(pod) and any(c["type"] == "Ready" and c["status"] == "True"
                             for c in pod["status"].get("conditions", []))


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kubectl_reports_the_real_server_version(dev_cluster):
    version = json.loads(dev_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == EXPECTED_SERVER_VERSION
    assert version["serverVersion"]["minor"] == EXPECTED_SERVER_VERSION.split(".")[1]


def test_fake_nodes_offer_eight_gpus(dev_cluster):
    nodes = dev_cluster.kubectl_json("get", "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(dev_cluster.nodes)
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"]


def test_gpu_pod_is_scheduled_run_probed_and_killed(dev_cluster, namespace):
    target = dev_cluster.nodes[-1]
    port = "8080"
    dev_cluster.apply(pod_manifest(
        "web", namespace, gpus=2, node=target,
        command=["python", "-m", "http.server", "--bind", "$(POD_IP)", port],
        readinessProbe={"httpGet": {"path": "/", "port": int(port)}, "periodSeconds": 1}))
    pod = dev_cluster.wait_for(lambda: (p := get_pod(dev_cluster, namespace, "web"))
                               and is_ready(p) and p, 60, "pod web Ready")
    assert pod["spec"]["nodeName"] == target
    pod_ip = pod["status"]["podIP"]
    assert ipaddress.ip_address(pod_ip) in dev_cluster.pod_network
    events = dev_cluster.kubectl_json("get", "events", "-n", namespace)["items"]
    assert any(e["reason"] == "Scheduled" and e.get("reportingComponent") == "default-scheduler"
               for e in events), events

    with urllib.request.urlopen(f"http://{pod_ip}:{port}/", timeout=5) as answer:
        assert answer.status == 200
    pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("process://"))
    assert process_alive(pid)

    dev_cluster.kubectl("delete", "pod", "web", "-n", namespace, "--wait=true", timeout_s=60)
    assert get_pod(dev_cluster, namespace, "web") is None
    dev_cluster.wait_for(lambda: not process_alive(pid), 10, f"pid {pid} to exit")
    with pytest.raises(OSError):
        socket.create_connection((pod_ip, int(port)), timeout=2).close()


def test_pod_asking_too_many_gpus_stays_pending(dev_cluster, namespace):
    dev_cluster.apply(pod_manifest("greedy", namespace, gpus=9, command=["sleep", "600"]))

    def failed_scheduling():
        events = dev_cluster.kubectl_json("get", "events", "-n", namespace,
                                          "--field-selector", "involvedObject.name=greedy")
        return [e for e in events["items"] if e["reason"] == "FailedScheduling"]

    events = dev_cluster.wait_for(failed_scheduling, 30, "a FailedScheduling event")
    assert "nvidia.com/gpu" in events[0]["message"]
    pod = get_pod(dev_cluster, namespace, "greedy")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")
    condition = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")


def test_restart_policy_never_reports_failure_and_on_failure_restarts(dev_cluster, namespace):
    exit_three = ["python", "-c", "import sys; print('bye'); sys.exit(3)"]
    never = pod_manifest("never", namespace, gpus=1, command=exit_three)
    never["spec"]["restartPolicy"] = "Never"
    again = pod_manifest("again", namespace, gpus=1, command=exit_three)
    again["spec"]["restartPolicy"] = "OnFailure"
    dev_cluster.apply(never)
    dev_cluster.apply(again)

    pod = dev_cluster.wait_for(lambda: (p := get_pod(dev_cluster, namespace, "never"))
                               and p["status"].get("phase") == "Failed" and p, 60, "never Failed")
    state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 3
    assert "bye" in dev_cluster.pod_log(namespace, "never")
    dev_cluster.wait_for(
        lambda: (p := get_pod(dev_cluster, namespace, "again")) and p["status"].get(
            "containerStatuses") and p["status"]["containerStatuses"][0]["restartCount"] >= 2,
        60, "again restarted twice")


def test_env_resolves_downward_api_and_labels(dev_cluster, namespace):
    manifest = pod_manifest("envy", namespace, gpus=1, command=[
        "python", "-c", "import os; print('ENV', os.environ['POD_IP'], os.environ['MY_NODE'], "
                        "os.environ['APP'], os.environ['NS'], os.environ['GREETING'])"])
    manifest["spec"]["restartPolicy"] = "Never"
    manifest["spec"]["containers"][0]["env"] += [
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "GREETING", "value": "hello-$(MY_NODE)"}]
    dev_cluster.apply(manifest)
    pod = dev_cluster.wait_for(lambda: (p := get_pod(dev_cluster, namespace, "envy"))
                               and p["status"].get("phase") == "Succeeded" and p, 60,
                               "envy Succeeded")
    node = pod["spec"]["nodeName"]
    expected = f"ENV {pod['status']['podIP']} {node} envy {namespace} hello-{node}"
    assert expected in dev_cluster.pod_log(namespace, "envy")
    # kubectl logs goes through kube-apiserver to the harness's kubelet endpoint.
    assert expected in dev_cluster.kubectl("logs", "envy", "-n", namespace).stdout


def test_tcp_and_exec_readiness_probes_gate_the_ready_condition(dev_cluster, namespace):
    serve = ["python", "-m", "http.server", "--bind", "$(POD_IP)", "9000"]
    dev_cluster.apply(pod_manifest("tcp", namespace, gpus=1, command=serve, readinessProbe={
        "tcpSocket": {"port": 9000}, "periodSeconds": 1}))
    dev_cluster.apply(pod_manifest("exec-false", namespace, gpus=1, command=serve,
                                   readinessProbe={"exec": {"command": ["false"]},
                                                   "periodSeconds": 1}))
    dev_cluster.apply(pod_manifest("exec-file", namespace, gpus=1, command=[
        "sh", "-c", "sleep 1; touch ready-marker; exec sleep 600"], readinessProbe={
        "exec": {"command": ["test", "-f", "ready-marker"]}, "periodSeconds": 1}))
    for name in ("tcp", "exec-file"):
        dev_cluster.wait_for(lambda: is_ready(get_pod(dev_cluster, namespace, name)), 60,
                             f"{name} Ready")
    never = get_pod(dev_cluster, namespace, "exec-false")
    assert never["status"]["phase"] == "Running"
    assert not is_ready(never)
    assert never["status"]["containerStatuses"][0]["started"]


def test_pod_runs_under_its_service_account(dev_cluster, namespace):
    manifest = pod_manifest("whoami", namespace, gpus=1,
                            command=["kubectl", "auth", "whoami", "-o", "json"])
    manifest["spec"]["restartPolicy"] = "Never"
    dev_cluster.apply(manifest)
    dev_cluster.wait_for(lambda: (p := get_pod(dev_cluster, namespace, "whoami"))
                         and p["status"].get("phase") == "Succeeded", 60, "whoami Succeeded")
    review = json.loads(dev_cluster.pod_log(namespace, "whoami"))
    assert review["status"]["userInfo"]["username"] == \
        f"system:serviceaccount:{namespace}:default"


def test_garbage_collector_removes_dependents_of_a_deleted_owner(dev_cluster, namespace):
    dev_cluster.kubectl("create", "configmap", "owner", "-n", namespace, "--from-literal=a=1")
    owner = dev_cluster.kubectl_json("get", "configmap", "owner", "-n", namespace)
    reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                 "uid": owner["metadata"]["uid"]}
    for index in range(2):
        dev_cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": f"dependent-{index}", "namespace": namespace,
                                        "ownerReferences": [reference]},
                           "data": {"b": "2"}})
    dev_cluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    def dependents_left():
        names = [item["metadata"]["name"] for item in
                 dev_cluster.kubectl_json("get", "configmaps", "-n", namespace)["items"]]
        return [name for name in names if name.startswith("dependent-")]

    dev_cluster.wait_for(lambda: not dependents_left(), 60, "dependents garbage-collected")


def test_helm_talks_to_the_cluster(dev_cluster):
    version = dev_cluster.helm("version", "--short").stdout.strip()
    assert version.startswith("v"), version
    listing = dev_cluster.helm("list", "--all-namespaces", "-o", "json").stdout
    assert json.loads(listing) == []
