"""Pure builders of every child object of a ServingReplica: ``build_*_spec(...) -> dict``.

    handle_reconcile: spec + placement --build_*_spec--> manifests --kopf.adopt--> API server

No API calls and no kopf here, so each manifest is unit-tested as plain data. The handlers
add owner references (``kopf.adopt``) and create or patch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from slipstream.crds import agent_config as agent_file
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.crds.servingreplica import PREFILL_ROLE
from slipstream.operator import naming
from slipstream.operator.instances import instance_role
from slipstream.operator.placement import NodeShare
from slipstream.operator.pod_security import (container_security_context, pod_security_context,
                                              scratch_env, scratch_mount, scratch_volume)

CONFIG_MOUNT_DIR = "/etc/slipstream"
ENGINE_CONFIG_FILE = "engine.yaml"
PVC_MOUNT_DIR = "/models"
MODEL_VOLUME = "model"
CONFIG_VOLUME = "engine-config"
KV_DISK_VOLUME = "kv-disk"  # spec.kvTiers.diskPath: an emptyDir of diskSize
# Our size units (crds KV_SIZE_PATTERN) as Kubernetes quantity suffixes.
_QUANTITY_SUFFIXES = {"KiB": "Ki", "MiB": "Mi", "GiB": "Gi", "TiB": "Ti", "KB": "k", "MB": "M",
                      "GB": "G", "TB": "T", "B": ""}
# The control port's token (control_credentials.py), mounted from the replica's Secret.
CONTROL_TOKEN_VOLUME = "control-token"
CONTROL_TOKEN_DIR = "/var/run/slipstream/control"
CONTROL_TOKEN_KEY = "token"
# The tenants file (spec.tenants), mounted from the user's Secret.
TENANTS_VOLUME = "tenants"
TENANTS_DIR = "/etc/slipstream/tenants"
TENANTS_KEY = "tenants.yaml"


def model_path(spec: ServingReplicaSpec) -> str:
    """Where the agent finds the model inside its container."""
    source = spec.model.source
    if source.host_path is not None:
        return source.host_path.path  # mounted at the same path: identical on every node
    assert source.pvc is not None  # the CRD's CEL rule guarantees exactly one source
    sub_path = source.pvc.sub_path.strip("/")
    return f"{PVC_MOUNT_DIR}/{sub_path}" if sub_path else PVC_MOUNT_DIR


def agent_config(spec: ServingReplicaSpec) -> agent_file.ServeConfig:
    """What every agent of the replica reads at start (``slipstream serve --config``)."""
    return agent_file.agent_config(spec, model_path(spec))


def template_hash(spec: ServingReplicaSpec) -> str:
    """A short hash of every spec field an agent pod is built from or reads at start: the
    engine config (model, parallelism, scheduler, SLO, pools threshold, drain, engine
    layout), the image, the model's volume and the placement rules. Pods carry it as a
    label; a spec change that alters it makes reconcile replace the instances one at a time
    (a rolling update). Fields that only count or move instances (instances, autoscaling,
    pool sizes, rebalance) leave it unchanged, so scaling never restarts anything."""
    shaping = {"config": agent_config(spec).to_yaml(only_set=True), "image": spec.image,
               "model": spec.model.model_dump(mode="json", by_alias=True),
               "placement": spec.placement.model_dump(mode="json", by_alias=True)}
    if spec.tenants is not None:  # only when set: existing replicas keep their hash
        shaping["tenants"] = spec.tenants.secret_name
    text = json.dumps(shaping, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build_config_map_spec(replica: str, namespace: str, spec: ServingReplicaSpec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": naming.config_map_name(replica), "namespace": namespace,
                     "labels": naming.common_labels(replica)},
        "data": {ENGINE_CONFIG_FILE: agent_config(spec).to_yaml(only_set=True)},
    }


def tenants_volume(spec: ServingReplicaSpec) -> list[dict]:
    if spec.tenants is None:
        return []
    return [{"name": TENANTS_VOLUME, "secret": {"secretName": spec.tenants.secret_name,
                                                "defaultMode": 0o440}}]


def tenants_mount(spec: ServingReplicaSpec) -> list[dict]:
    if spec.tenants is None:
        return []
    return [{"name": TENANTS_VOLUME, "mountPath": TENANTS_DIR, "readOnly": True}]


def tenants_flag(spec: ServingReplicaSpec) -> list[str]:
    return [] if spec.tenants is None else ["--tenants", f"{TENANTS_DIR}/{TENANTS_KEY}"]


def build_control_secret_spec(replica: str, namespace: str, token: str) -> dict:
    """The replica's control-port token, for its agents to check (never read back)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": naming.control_secret_name(replica), "namespace": namespace,
                     "labels": naming.common_labels(replica)},
        "stringData": {CONTROL_TOKEN_KEY: token},
    }


def build_instance_service_spec(replica: str, namespace: str, instance: str) -> dict:
    """Headless Service of one instance: stable DNS names for its ranks (rank discovery)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": instance, "namespace": namespace,
                     "labels": {**naming.common_labels(replica), naming.INSTANCE_LABEL: instance}},
        "spec": {
            "clusterIP": "None",
            # Ranks must find each other before any of them is Ready.
            "publishNotReadyAddresses": True,
            "selector": {naming.INSTANCE_LABEL: instance},
            "ports": [{"name": "http", "port": naming.HTTP_PORT},
                      {"name": "grpc-control", "port": naming.CONTROL_PORT},
                      {"name": "parallel", "port": naming.PARALLEL_CONTROLLER_PORT},
                      {"name": "rendezvous", "port": naming.RENDEZVOUS_PORT}],
        },
    }


def build_client_service_spec(replica: str, namespace: str, pool: str | None = None, *,
                              via_router: bool = False) -> dict:
    """The client endpoint: every instance's rank-0 pod, only those of one pool, or (with
    pools) the router pods (router.py), which pick the pool by prompt length. The pool
    Services follow the pods' pool label, so a rebalance move reroutes traffic by relabelling."""
    selector = {naming.REPLICA_LABEL: replica, naming.ROLE_LABEL: naming.ROLE_CONTROLLER}
    name = naming.client_service_name(replica)
    if via_router:
        assert pool is None
        selector = {naming.ROUTER_LABEL: replica}
    if pool is not None:
        selector[naming.POOL_LABEL] = pool
        name = naming.pool_service_name(replica, pool)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": naming.common_labels(replica)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": naming.HTTP_PORT, "targetPort": "http"}],
        },
    }


def build_agent_pod_spec(replica: str, namespace: str, spec: ServingReplicaSpec, *,
                         instance: str, index: int, incarnation: str, share: NodeShare,
                         rank: int, num_ranks: int, pool: str,
                         control_auth: bool = False) -> dict:
    """Pod ``rank`` (0 = controller) of one instance: ``share.gpus`` GPUs on ``share.node``.
    With ``control_auth`` the controller mounts the replica's control token and its control
    port requires it."""
    is_controller = rank == 0
    role = naming.ROLE_CONTROLLER if is_controller else naming.ROLE_WORKER
    labels = {
        **naming.common_labels(replica),
        "app.kubernetes.io/component": "agent",
        naming.INSTANCE_LABEL: instance,
        naming.INSTANCE_INDEX_LABEL: str(index),
        naming.INCARNATION_LABEL: incarnation,
        naming.RANK_LABEL: str(rank),
        naming.NUM_RANKS_LABEL: str(num_ranks),
        naming.ROLE_LABEL: role,
        naming.POOL_LABEL: pool,
        naming.TEMPLATE_HASH_LABEL: template_hash(spec),
    }
    annotations = {}
    if is_controller:
        annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(naming.HTTP_PORT),
                       "prometheus.io/path": "/metrics"}
    pod_spec: dict[str, Any] = {
        # An NCCL group does not survive a member: the operator recreates the whole instance
        # when any pod fails, so the kubelet must not restart containers in place.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "hostname": f"rank-{rank}",
        "subdomain": instance,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [share.node]}]}]}}},
        "securityContext": pod_security_context(),
        "containers": [_agent_container(replica, namespace, spec, instance, share, rank,
                                        num_ranks, pool, control_auth and rank == 0)],
        "volumes": _volumes(replica, spec, control_auth and rank == 0) + (
            tenants_volume(spec) if rank == 0 else []),
    }
    if spec.placement.node_selector:
        pod_spec["nodeSelector"] = dict(spec.placement.node_selector)
    if spec.placement.tolerations:
        pod_spec["tolerations"] = [t.to_api() for t in spec.placement.tolerations]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": naming.pod_name(instance, incarnation, rank), "namespace": namespace,
                     "labels": labels, "annotations": annotations},
        "spec": pod_spec,
    }


# Before SIGTERM the kubelet runs the preStop hook: a pause that lets the endpoint controllers
# and the router take the pod out of rotation, so that the drain sees few new requests.
PRE_STOP_SLEEP_SECONDS = 5
# After the drain period: the cut streams' last events, the engine's and workers' exit.
DRAIN_MARGIN_SECONDS = 10


def termination_grace_seconds(spec: ServingReplicaSpec) -> int:
    """Time from deletion to SIGKILL: the preStop pause, the agent's drain, a margin."""
    return PRE_STOP_SLEEP_SECONDS + spec.drain_timeout_seconds + DRAIN_MARGIN_SECONDS


def agent_command(*, rank: int, role: str | None = None, control_auth: bool = False,
                  tenants: list[str] | None = None) -> list[str]:
    """Pod 0 runs the controller (HTTP, scheduler) and its node's ranks; every further pod
    runs `slipstream worker` for its node's ranks. The rank layout comes from the
    SLIPSTREAM_* variables (see ``parallel_env``). Everything the spec says about the engine
    is in the mounted ConfigMap; the flags are only the ports the pod declares (the address
    to bind is $POD_IP, which the agent reads itself), ``--no-profile`` and, with
    disaggregation, the role.

    ``--no-profile``: a pod's file system does not outlive it, so a server that profiled
    itself on start (``slipstream serve`` does, outside a cluster) would profile again in
    every pod that autoscaling, a rolling update or a restart creates, minutes before it can
    be ready. Pods pack a fixed token budget until a profile made once per node and GPU type
    can be handed to them (docs/scheduling.md)."""
    if rank > 0:
        return ["slipstream", "worker"]
    command = ["slipstream", "serve", "--config", f"{CONFIG_MOUNT_DIR}/{ENGINE_CONFIG_FILE}",
               "--port", str(naming.HTTP_PORT), "--control-port", str(naming.CONTROL_PORT),
               "--no-profile"]
    if control_auth:
        command += ["--control-token-file", f"{CONTROL_TOKEN_DIR}/{CONTROL_TOKEN_KEY}"]
    command += tenants or []
    if role is not None:
        command += ["--role", role]
    if role == PREFILL_ROLE:
        command += ["--kv-side-channel-port", str(naming.KV_SIDE_CHANNEL_PORT)]
    return command


def parallel_env(spec: ServingReplicaSpec, namespace: str, instance: str, share: NodeShare,
                 num_pods: int) -> list[dict]:
    """The multi-node interface of `slipstream serve`/`worker` (agent/parallel/env.py). A
    single-pod instance needs none of it beyond the world size: its controller starts every
    rank locally."""
    world_size = spec.parallelism.gpus_per_instance
    env = [{"name": "SLIPSTREAM_WORLD_SIZE", "value": str(world_size)}]
    if num_pods == 1:
        return env
    controller_host = f"rank-0.{instance}.{namespace}.svc"
    last_rank = share.first_rank + share.gpus - 1
    return env + [
        {"name": "SLIPSTREAM_NODE_RANKS", "value": f"{share.first_rank}-{last_rank}"},
        {"name": "SLIPSTREAM_CONTROLLER_ADDR",
         "value": f"{controller_host}:{naming.PARALLEL_CONTROLLER_PORT}"},
        {"name": "MASTER_ADDR", "value": controller_host},
        {"name": "MASTER_PORT", "value": str(naming.RENDEZVOUS_PORT)},
    ]


def _agent_container(replica: str, namespace: str, spec: ServingReplicaSpec, instance: str,
                     share: NodeShare, rank: int, num_ranks: int, pool: str,
                     control_auth: bool) -> dict:
    gpu_resource = spec.placement.gpu_resource
    role = instance_role(spec, pool)
    ports = [{"name": "http", "containerPort": naming.HTTP_PORT},
             {"name": "grpc-control", "containerPort": naming.CONTROL_PORT},
             {"name": "parallel", "containerPort": naming.PARALLEL_CONTROLLER_PORT},
             {"name": "rendezvous", "containerPort": naming.RENDEZVOUS_PORT}]
    if role == PREFILL_ROLE and rank == 0:
        ports.append({"name": "kv-side", "containerPort": naming.KV_SIDE_CHANNEL_PORT})
    container: dict[str, Any] = {
        "name": "agent",
        "image": spec.image,
        "command": agent_command(rank=rank, role=role, control_auth=control_auth,
                                 tenants=tenants_flag(spec) if rank == 0 else []),
        "env": [
            _field_env("POD_IP", "status.podIP"),
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            _field_env("NODE_NAME", "spec.nodeName"),
            # The pool is read from the pod's label at start; a rebalance move relabels the
            # pod and tells the running agent over the control API.
            _field_env("SLIPSTREAM_POOL", f"metadata.labels['{naming.POOL_LABEL}']"),
            {"name": "SLIPSTREAM_REPLICA", "value": replica},
            {"name": "SLIPSTREAM_INSTANCE", "value": instance},
            *parallel_env(spec, namespace, instance, share, num_ranks),
            *scratch_env(),
        ],
        "ports": ports,
        "resources": {"requests": {gpu_resource: str(share.gpus)},
                      "limits": {gpu_resource: str(share.gpus)}},
        "securityContext": container_security_context(),
        "volumeMounts": _volume_mounts(spec, control_auth) + (
            tenants_mount(spec) if rank == 0 else []),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}},
    }
    if rank == 0:
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"},
                                       "periodSeconds": 2, "timeoutSeconds": 2,
                                       "failureThreshold": 3}
        # Generous: a large model loads for minutes; after that a hung engine is restarted
        # (as a whole instance, since restartPolicy is Never).
        container["livenessProbe"] = {"httpGet": {"path": "/health", "port": "http"},
                                      "initialDelaySeconds": 600, "periodSeconds": 10,
                                      "timeoutSeconds": 5, "failureThreshold": 6}
    return container


def _field_env(name: str, field_path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def model_volume(spec: ServingReplicaSpec) -> dict:
    """The model's volume: the node's hostPath, or a read-only PVC."""
    source = spec.model.source
    if source.host_path is not None:
        return {"name": MODEL_VOLUME,
                "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    assert source.pvc is not None
    return {"name": MODEL_VOLUME, "persistentVolumeClaim": {
        "claimName": source.pvc.claim_name, "readOnly": True}}


def model_volume_mount(spec: ServingReplicaSpec) -> dict:
    source = spec.model.source
    model_mount = source.host_path.path if source.host_path is not None else PVC_MOUNT_DIR
    return {"name": MODEL_VOLUME, "mountPath": model_mount, "readOnly": True}


def _volumes(replica: str, spec: ServingReplicaSpec, control_auth: bool) -> list[dict]:
    volumes = [model_volume(spec),
               {"name": CONFIG_VOLUME, "configMap": {"name": naming.config_map_name(replica)}},
               scratch_volume()]
    if control_auth:
        volumes.append({"name": CONTROL_TOKEN_VOLUME, "secret": {
            "secretName": naming.control_secret_name(replica), "defaultMode": 0o440}})
    tiers = spec.kv_tiers
    if tiers is not None and tiers.disk_path is not None and tiers.disk_size is not None:
        volumes.append({"name": KV_DISK_VOLUME,
                        "emptyDir": {"sizeLimit": kubernetes_quantity(tiers.disk_size)}})
    return volumes


def _volume_mounts(spec: ServingReplicaSpec, control_auth: bool) -> list[dict]:
    mounts = [model_volume_mount(spec),
              {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT_DIR, "readOnly": True},
              scratch_mount()]
    if control_auth:
        mounts.append({"name": CONTROL_TOKEN_VOLUME, "mountPath": CONTROL_TOKEN_DIR,
                       "readOnly": True})
    tiers = spec.kv_tiers
    if tiers is not None and tiers.disk_path is not None and tiers.disk_size is not None:
        mounts.append({"name": KV_DISK_VOLUME, "mountPath": tiers.disk_path})
    return mounts


def kubernetes_quantity(size: str) -> str:
    """A size as ``--kv-disk-size`` takes it (``2TiB``, ``500GB``) as a Kubernetes quantity
    (``2Ti``, ``500G``)."""
    for unit in sorted(_QUANTITY_SUFFIXES, key=len, reverse=True):
        if size.endswith(unit):
            return size[:-len(unit)] + _QUANTITY_SUFFIXES[unit]
    raise ValueError(f"{size!r} has no size unit")
