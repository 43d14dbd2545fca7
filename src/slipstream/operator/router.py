"""Pure builders of the router of a ServingReplica with ``spec.pools`` or ``spec.disaggregation``.

    spec.pools or spec.disaggregation set
                   --handle_reconcile--> ServiceAccount <replica>-router
                                         RoleBinding <replica>-router -> ClusterRole
                                           slipstream-router (pods get/list/watch; the chart)
                                         Deployment <replica>-router: `slipstream router`
                                         client Service <replica> --selects--> router pods
    router pods --watch agent pods (slipstream.dev/replica=<replica>, role=controller)-->
      route by prompt length to the pod labelled slipstream.dev/pool=short|long (or unified);
      with pods labelled slipstream.dev/pool=decode, continue each request on one of them

Without either, the client Service selects the agents' rank-0 pods directly (builders.py). The
router pods carry no ``slipstream.dev/replica`` label on purpose: the operator counts every
pod with that label as part of an instance, and the router is not one.
"""

from __future__ import annotations

from typing import Any

from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, naming, pod_security

ROUTER_CONTAINER = "router"


def router_labels(replica: str) -> dict[str, str]:
    """Labels of the router's Deployment and pods; the client Service selects them."""
    return {"app.kubernetes.io/name": "slipstream-router",
            "app.kubernetes.io/instance": replica,
            "app.kubernetes.io/managed-by": "slipstream-operator",
            naming.ROUTER_LABEL: replica}


def router_selector(replica: str) -> dict[str, str]:
    return {naming.ROUTER_LABEL: replica}


def agent_selector(replica: str) -> str:
    """The agent pods the router routes to: each instance's rank 0, which serves HTTP."""
    return f"{naming.REPLICA_LABEL}={replica},{naming.ROLE_LABEL}={naming.ROLE_CONTROLLER}"


def wants_router(spec: ServingReplicaSpec) -> bool:
    """Pools need the length-aware choice; disaggregation needs the prefill -> decode chain."""
    return spec.pools is not None or spec.disaggregation is not None


def router_command(replica: str, namespace: str, spec: ServingReplicaSpec) -> list[str]:
    assert wants_router(spec)
    command = ["slipstream", "router", "--namespace", namespace,
               "--selector", agent_selector(replica)]
    if spec.pools is not None:
        command += ["--long-prefill-threshold-tokens",
                    str(spec.pools.long_prefill_threshold_tokens)]
    if spec.scheduler.policy == "fcfs":
        # FCFS agents make a new request wait behind their whole backlog; the router's
        # default assumes the other policies, which serve shorter prefills first.
        command += ["--instance-queue-order", "fifo"]
    # The tokenizer makes the length classes match the agents' token counts. Decode
    # instances (pool label "decode") make the router chain each request through a prefill
    # and a decode instance.
    return command + builders.tenants_flag(spec) + [
        "--model", builders.model_path(spec), "--host", "$(POD_IP)",
        "--port", str(naming.HTTP_PORT)]


def build_router_service_account_spec(replica: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": naming.router_name(replica), "namespace": namespace,
                         "labels": router_labels(replica)}}


def build_router_role_binding_spec(replica: str, namespace: str) -> dict:
    """Binds the chart's read-only ClusterRole in this namespace only: the router sees the
    pods of its own namespace and nothing else."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": naming.router_name(replica), "namespace": namespace,
                         "labels": router_labels(replica)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": naming.ROUTER_CLUSTER_ROLE},
            "subjects": [{"kind": "ServiceAccount", "name": naming.router_name(replica),
                          "namespace": namespace}]}


def build_router_deployment_spec(replica: str, namespace: str, spec: ServingReplicaSpec,
                                 replicas: int = 1) -> dict:
    """The router Deployment: stateless, so any number of replicas behind the client Service
    agree on routing (each watches the same pod labels)."""
    labels = router_labels(replica)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": naming.router_name(replica),
        "terminationGracePeriodSeconds": 10,
        "securityContext": pod_security.pod_security_context(),
        "containers": [_router_container(replica, namespace, spec)],
        "volumes": [builders.model_volume(spec), *builders.tenants_volume(spec)],
    }
    if spec.placement.node_selector:
        pod_spec["nodeSelector"] = dict(spec.placement.node_selector)
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [t.to_api() for t in spec.placement.tolerations]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": naming.router_name(replica), "namespace": namespace,
                     "labels": labels},
        "spec": {"replicas": replicas, "selector": {"matchLabels": router_selector(replica)},
                 "template": {"metadata": {"labels": labels, "annotations": {
                     "prometheus.io/scrape": "true",
                     "prometheus.io/port": str(naming.HTTP_PORT),
                     "prometheus.io/path": "/metrics"}},
                     "spec": pod_spec}},
    }


def _router_container(replica: str, namespace: str, spec: ServingReplicaSpec) -> dict:
    return {
        "name": ROUTER_CONTAINER,
        "image": spec.image,
        "command": router_command(replica, namespace, spec),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        # The router writes nothing (the image sets PYTHONDONTWRITEBYTECODE): no scratch
        # volume under its read-only root.
        "securityContext": pod_security.container_security_context(),
        "ports": [{"name": "http", "containerPort": naming.HTTP_PORT}],
        # Ready once it sees at least one Ready agent pod: until then it could only answer 503.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                           "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "initialDelaySeconds": 30,
                          "periodSeconds": 10, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "volumeMounts": [builders.model_volume_mount(spec), *builders.tenants_mount(spec)],
    }
