"""Names and labels of everything the operator creates for a ServingReplica.

    ServingReplica "chat" (namespace ns)
      ConfigMap  chat-engine              engine config, mounted by every agent pod
      Service    chat                     client endpoint: every instance's rank-0 pod
      Service    chat-short / chat-long   per-pool endpoints (only with spec.pools)
      instance   chat-0, chat-1, ...      tp x spp x kvp GPUs each
        Service  chat-0                   headless, for rank discovery inside the instance
        Pod      chat-0-<incarnation>-0   rank 0 (controller, serves HTTP), then one pod per
                 chat-0-<incarnation>-1   further node share (workers)

The incarnation suffix changes each time an instance is recreated, so a new pod never waits
for its predecessor's name to be released. Labels are how the operator finds its children
again after a restart: it keeps no state of its own beyond the ServingReplica's status.
"""

from __future__ import annotations

import hashlib

PREFIX = "slipstream.dev"
REPLICA_LABEL = f"{PREFIX}/replica"
INSTANCE_LABEL = f"{PREFIX}/instance"
INSTANCE_INDEX_LABEL = f"{PREFIX}/instance-index"
INCARNATION_LABEL = f"{PREFIX}/incarnation"
RANK_LABEL = f"{PREFIX}/rank"
NUM_RANKS_LABEL = f"{PREFIX}/num-ranks"
ROLE_LABEL = f"{PREFIX}/role"
POOL_LABEL = f"{PREFIX}/pool"
# On the router's pods instead of REPLICA_LABEL: they are no part of any instance.
ROUTER_LABEL = f"{PREFIX}/router"
# Created by the chart (pods get/list/watch); bound per namespace to each router.
ROUTER_CLUSTER_ROLE = "slipstream-router"
ROLE_CONTROLLER = "controller"
ROLE_WORKER = "worker"
# Scale-down: the autoscaler marks every pod of the instance it removes. The controller pod's
# role becomes "draining", so the client Service and the router (both select
# role=controller) drop it; the pods go once nothing is in flight or the drain bound passed.
DRAINING_LABEL = f"{PREFIX}/draining"
DRAINING_SINCE_ANNOTATION = f"{PREFIX}/draining-since"  # Unix seconds, when the drain began
ROLE_DRAINING = "draining"
# A hash of everything in the spec that shapes an agent pod (builders.template_hash). When the
# spec changes it, the running instances are outdated and are replaced one at a time.
TEMPLATE_HASH_LABEL = f"{PREFIX}/template-hash"

HTTP_PORT = 8000
CONTROL_PORT = 50051
# Multi-node instances: the controller's ZeroMQ socket and rank 0's torch.distributed
# rendezvous, both in the rank-0 pod, reached through the instance's headless Service.
PARALLEL_CONTROLLER_PORT = 29400
RENDEZVOUS_PORT = 29500
# Prefill instances of a disaggregated replica: the KV side channel decode instances ask for
# blocks and acknowledge on (the Mooncake engine's own RPC port is chosen at start and
# travels in each transfer's handle).
KV_SIDE_CHANNEL_PORT = 5570
# Kubernetes object names are DNS labels for pods' hostnames and services: 63 characters.
MAX_NAME_LENGTH = 63


def common_labels(replica: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "slipstream-agent",
        "app.kubernetes.io/instance": replica,
        "app.kubernetes.io/managed-by": "slipstream-operator",
        REPLICA_LABEL: replica,
    }


def replica_selector(replica: str) -> str:
    """Label selector (string form) of every agent pod of the replica."""
    return f"{REPLICA_LABEL}={replica}"


def instance_name(replica: str, index: int) -> str:
    return _fit(f"{replica}-{index}")


def config_map_name(replica: str) -> str:
    return _fit(f"{replica}-engine")


def client_service_name(replica: str) -> str:
    return _fit(replica)


def pool_service_name(replica: str, pool: str) -> str:
    return _fit(f"{replica}-{pool}")


def control_secret_name(replica: str) -> str:
    """The replica's control-port token (operator/control_credentials.py)."""
    return _fit(f"{replica}-control")


def router_name(replica: str) -> str:
    return _fit(f"{replica}-router")


def pod_name(instance: str, incarnation: str, rank: int) -> str:
    return _fit(f"{instance}-{incarnation}-{rank}")


def new_incarnation(instance: str, salt: str) -> str:
    """A short suffix unique to one incarnation of an instance (``salt``: time, uid...)."""
    return hashlib.sha256(f"{instance}/{salt}".encode()).hexdigest()[:5]


def endpoint(replica: str, namespace: str) -> str:
    return f"http://{client_service_name(replica)}.{namespace}.svc:{HTTP_PORT}/v1"


def _fit(name: str) -> str:
    """Names longer than a DNS label keep their start and get a hash of the whole."""
    if len(name) <= MAX_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:MAX_NAME_LENGTH - 9].rstrip('-')}-{digest}"
