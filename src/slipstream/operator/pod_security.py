"""How every pod the operator builds runs: as the images' non-root user, with a read-only root,
no capabilities and the RuntimeDefault seccomp profile, and a small writable /tmp."""

from __future__ import annotations


# Pods run with a read-only root file system: what the agent writes (runtime profiles, GGUF
# conversions, compiler caches, temporary files) goes to this emptyDir.
SCRATCH_VOLUME = "scratch"


SCRATCH_DIR = "/tmp"


NON_ROOT_UID = 65532  # the images' user (Dockerfile.agent, Dockerfile.operator)


def pod_security_context() -> dict:
    """Every pod the operator creates: not root, the runtime's default seccomp profile."""
    return {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID,
            "fsGroup": NON_ROOT_UID, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict:
    """Every container: no privilege escalation, no capabilities, a read-only root. (RDMA
    transports that register memory need IPC_LOCK back; docs/tenancy.md.)"""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def scratch_env() -> list[dict]:
    """Caches and HOME on the scratch volume, since the root file system is read-only."""
    return [{"name": "HOME", "value": f"{SCRATCH_DIR}/home"},
            {"name": "XDG_CACHE_HOME", "value": f"{SCRATCH_DIR}/cache"}]


def scratch_volume() -> dict:
    return {"name": SCRATCH_VOLUME, "emptyDir": {}}


def scratch_mount() -> dict:
    return {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}
