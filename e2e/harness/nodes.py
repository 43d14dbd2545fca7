"""Fake GPU nodes: their Node objects and the heartbeats that keep them Ready.

Part of the test-harness kubelet. The scheduler places pods on these nodes by their
`nvidia.com/gpu` allocatable and labels; kube-controller-manager's node lifecycle controller
taints and evicts from any node whose Lease and Ready heartbeat go stale, so the harness renews
both, as a real kubelet does.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from kubeapi import ApiError, JSON, KubeApi

FAKE_NODE_LABEL = "slipstream.dev/fake-node"
LEASE_DURATION_S = 40


@dataclass(frozen=True)
class FakeNodeSpec:
    """The shape of every fake GPU node in one dev cluster."""

    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpu_memory_mib: int = 81559
    cpu_cores: int = 64
    memory_gib: int = 512
    max_pods: int = 110
    kubelet_version: str = "v1.37.1"


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_name(index: int) -> str:
    return f"gpu-node-{index}"


def build_node(name: str, index: int, spec: FakeNodeSpec) -> JSON:
    """The Node object as a GPU node with the NVIDIA device plugin and GPU feature discovery
    would look; status is sent separately because create ignores it."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "topology.kubernetes.io/zone": f"zone-{index % 2}",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": spec.gpu_product,
                "nvidia.com/gpu.count": str(spec.gpus_per_node),
                "nvidia.com/gpu.memory": str(spec.gpu_memory_mib),
                FAKE_NODE_LABEL: "true",
            },
        },
        "spec": {},
    }


def build_node_status(spec: FakeNodeSpec, kubelet_port: int) -> JSON:
    resources = {
        "cpu": str(spec.cpu_cores),
        "memory": f"{spec.memory_gib}Gi",
        "pods": str(spec.max_pods),
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(spec.gpus_per_node),
    }
    return {
        "capacity": resources,
        "allocatable": resources,
        "conditions": node_conditions(),
        # Only an IP: kube-apiserver prefers a Hostname address for `kubectl logs`, and
        # "localhost" may resolve to ::1, where the harness does not listen.
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "kubeletVersion": spec.kubelet_version,
            "kubeProxyVersion": "",
            "containerRuntimeVersion": "slipstream-process-runtime://0.1",
            "operatingSystem": "linux",
            "architecture": "amd64",
            "osImage": "local processes (slipstream e2e harness)",
            "kernelVersion": "",
            "machineID": "", "systemUUID": "", "bootID": "",
        },
    }


def node_conditions() -> list[JSON]:
    now = now_rfc3339()
    healthy = [("MemoryPressure", "False", "KubeletHasSufficientMemory"),
               ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
               ("PIDPressure", "False", "KubeletHasSufficientPID"),
               ("Ready", "True", "KubeletReady")]
    return [{"type": kind, "status": status, "reason": reason, "message": reason,
             "lastHeartbeatTime": now, "lastTransitionTime": now}
            for kind, status, reason in healthy]


def register_node(api: KubeApi, name: str, index: int, spec: FakeNodeSpec,
                  kubelet_port: int) -> None:
    try:
        api.post("/api/v1/nodes", build_node(name, index, spec))
    except ApiError as error:
        if error.status != 409:
            raise
    api.patch(f"/api/v1/nodes/{name}/status", {"status": build_node_status(spec, kubelet_port)},
              strategy="merge")


def heartbeat_node(api: KubeApi, name: str) -> None:
    """Renew the node Lease and the Ready condition's heartbeat."""
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
    lease = api.get(lease_path, ok_missing=True)
    if lease is None:
        try:
            api.post("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_S,
                         "renewTime": now_micro()},
            })
        except ApiError as error:
            if error.status not in (404, 409):  # the namespace may not exist yet
                raise
    else:
        api.patch(lease_path, {"spec": {"renewTime": now_micro(), "holderIdentity": name}},
                  strategy="merge")
    # Strategic merge keys conditions by type: heartbeat and status change, transition
    # times stay (a node the lifecycle controller marked Unknown comes back to Ready).
    now = now_rfc3339()
    conditions = [{key: value for key, value in condition.items() if key != "lastTransitionTime"}
                  for condition in node_conditions()]
    for condition in conditions:
        condition["lastHeartbeatTime"] = now
    api.patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": conditions}})
