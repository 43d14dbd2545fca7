"""Command lines, credentials and kubeconfigs of the dev cluster's control-plane processes.

Pure builders used by `devcluster.py`: given the chosen ports and file locations they return
argv lists and file contents. The set-up is envtest-like: etcd on loopback, kube-apiserver with
a static token file and RBAC, and the scheduler and controller-manager under their own
identities (`system:kube-scheduler`, `system:kube-controller-manager`), which the API server's
bootstrap RBAC policy already grants what they need, as in a kubeadm cluster.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


@dataclass(frozen=True)
class Identity:
    """One static-token user of the API server."""

    user: str
    groups: tuple[str, ...]
    token: str

    @property
    def file_stem(self) -> str:
        return self.user.replace("system:", "").replace(":", "-")


def make_identities() -> dict[str, Identity]:
    def new(user: str, *groups: str) -> Identity:
        return Identity(user, groups, secrets.token_hex(24))

    return {
        "admin": new("admin", "system:masters"),
        "kube-scheduler": new("system:kube-scheduler"),
        "kube-controller-manager": new("system:kube-controller-manager"),
        # The harness kubelet registers nodes, renews leases and writes pod status; kubelet's
        # own Node authorizer is not enabled, so it acts as a cluster admin.
        "harness-kubelet": new("slipstream:harness-kubelet", "system:masters"),
    }


def token_file_text(identities: dict[str, Identity]) -> str:
    """kube-apiserver --token-auth-file: token,user,uid,"group1,group2"."""
    return "".join(f'{i.token},{i.user},{i.user},"{",".join(i.groups)}"\n'
                   for i in identities.values())


def kubeconfig_text(server: str, identity: Identity, namespace: str = "default") -> str:
    """A kubeconfig with a bearer token; the serving certificate is self-signed."""
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "slipstream-dev",
        "clusters": [{"name": "slipstream-dev",
                      "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": identity.user, "user": {"token": identity.token}}],
        "contexts": [{"name": "slipstream-dev", "context": {
            "cluster": "slipstream-dev", "user": identity.user, "namespace": namespace}}],
        "preferences": {},
    }, indent=2) + "\n"


def etcd_argv(bin_dir: Path, data_dir: Path, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [str(bin_dir / "etcd"), "--name=default", f"--data-dir={data_dir}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}", "--initial-cluster-state=new",
            # A throwaway test store: skipping fsync makes start-up and writes fast.
            "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648"]


def apiserver_argv(bin_dir: Path, pki_dir: Path, token_file: Path, ports: Ports) -> list[str]:
    return [str(bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={ports.apiserver}",
            # No certificate given: kube-apiserver writes a self-signed one into --cert-dir.
            f"--cert-dir={pki_dir / 'apiserver'}",
            f"--token-auth-file={token_file}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki_dir / 'sa.pub'}",
            f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            # Loopback advertise addresses are refused by the endpoint reconciler; nothing in
            # the harness routes through the `kubernetes` Service anyway.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--profiling=false", "--v=1"]


def controller_manager_argv(bin_dir: Path, pki_dir: Path, kubeconfig: Path,
                            ports: Ports) -> list[str]:
    return [str(bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={ports.controller_manager}",
            f"--cert-dir={pki_dir / 'controller-manager'}",
            "--leader-elect=false",
            # Each controller (the garbage collector among them) runs under its own service
            # account with its bootstrap role, as kubeadm sets it up.
            "--use-service-account-credentials=true",
            "--controllers=*",
            f"--service-account-private-key-file={pki_dir / 'sa.key'}",
            f"--root-ca-file={pki_dir / 'apiserver' / 'apiserver.crt'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--profiling=false", "--v=1"]


def scheduler_argv(bin_dir: Path, pki_dir: Path, kubeconfig: Path, ports: Ports) -> list[str]:
    return [str(bin_dir / "kube-scheduler"),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={ports.scheduler}",
            f"--cert-dir={pki_dir / 'scheduler'}",
            "--leader-elect=false", "--profiling=false", "--v=1"]


def harness_kubelet_argv(python: str, harness_dir: Path, bin_dir: Path, server: str,
                         token_file: Path, state_dir: Path, node_count: int, gpus_per_node: int,
                         gpu_product: str, pod_cidr: str, kubelet_version: str) -> list[str]:
    return [python, str(harness_dir / "kubelet.py"), f"--server={server}",
            f"--token-file={token_file}", f"--state-dir={state_dir}",
            f"--nodes={node_count}", f"--gpus-per-node={gpus_per_node}",
            f"--gpu-product={gpu_product}", f"--pod-cidr={pod_cidr}",
            f"--kubelet-version={kubelet_version}",
            # Pods may call kubectl and helm, as hooks and scripts in real images do.
            f"--path-prepend={bin_dir}"]
