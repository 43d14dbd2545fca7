"""GPU capacity of the cluster as placement sees it. Pure: Node and Pod dicts in, NodeGpus out.

    GET nodes + GET pods (all namespaces, not terminal) --gpu_nodes()--> [NodeGpus] --> placement

A node's free GPUs are its allocatable GPUs minus what the non-terminal pods bound to it
request. Pods that are terminating are left out on purpose: an instance being recreated
takes the GPUs its old pods are giving back, and kube-scheduler holds the new pod until they
are really free, so the instance comes back on the same nodes.
"""

from __future__ import annotations

from slipstream.operator.placement import NodeGpus, Taint, TolerationRule


def quantity_to_int(value: object) -> int:
    """Whole-unit quantities (GPUs are counted, never fractional); anything else is 0."""
    try:
        return int(str(value))
    except ValueError:
        return 0


def pod_gpu_request(pod: dict, resource: str) -> int:
    """GPUs a pod holds: the sum over its containers (requests, or limits when unset)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        amount = (resources.get("requests") or {}).get(resource)
        if amount is None:
            amount = (resources.get("limits") or {}).get(resource)
        total += quantity_to_int(amount) if amount is not None else 0
    return total


def holds_gpus(pod: dict) -> bool:
    status_phase = (pod.get("status") or {}).get("phase")
    if status_phase in ("Succeeded", "Failed"):
        return False
    return (pod.get("metadata") or {}).get("deletionTimestamp") is None


def gpu_nodes(nodes: list[dict], pods: list[dict], resource: str) -> list[NodeGpus]:
    used: dict[str, int] = {}
    for pod in pods:
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name and holds_gpus(pod):
            used[node_name] = used.get(node_name, 0) + pod_gpu_request(pod, resource)
    result = []
    for node in nodes:
        metadata, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
        allocatable = quantity_to_int((status.get("allocatable") or {}).get(resource, 0))
        if allocatable <= 0:
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions") or [])
        taints = tuple(Taint(key=t.get("key", ""), effect=t.get("effect", ""),
                             value=t.get("value", "")) for t in spec.get("taints") or [])
        result.append(NodeGpus(
            name=metadata["name"], allocatable_gpus=allocatable,
            used_gpus=used.get(metadata["name"], 0), labels=dict(metadata.get("labels") or {}),
            taints=taints, schedulable=ready and not spec.get("unschedulable", False)))
    return result


def toleration_rules(tolerations: list[dict]) -> tuple[TolerationRule, ...]:
    return tuple(TolerationRule(key=t.get("key"), operator=t.get("operator") or "Equal",
                                value=t.get("value"), effect=t.get("effect"))
                 for t in tolerations)
