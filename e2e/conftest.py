"""Session fixtures for the e2e tier: one real local control plane per test session.

`dev_cluster` builds (or reuses the cached) Kubernetes binaries, starts etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and the harness kubelet with fake GPU
nodes in a fresh state dir, and stops every process it started, by pid, when the session ends.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent


def _load(module_name: str, path: Path):
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


devcluster = _load("slipstream_e2e_devcluster", E2E_DIR / "cluster" / "devcluster.py")
handle = _load("slipstream_e2e_handle", E2E_DIR / "cluster" / "handle.py")
DevCluster = handle.DevCluster
wait_for = handle.wait_for


_background_build = None


def pytest_collection_finish(session: pytest.Session) -> None:
    """When e2e tests are selected, start the control plane's build now (niced), so that a
    first run builds while the earlier tiers run instead of after them."""
    global _background_build
    if session.config.option.collectonly or not any(
            item.get_closest_marker("e2e") for item in session.items):
        return
    started = devcluster.build.start_background_build()
    if started is not None:
        _background_build, log_file = started
        print(f"\n[k8s-build] building the control plane in the background (log {log_file})",
              file=sys.stderr, flush=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ends before the build does stops it (its stamps are per binary, so
    the next session goes on from the binaries already built)."""
    if _background_build is not None and _background_build.poll() is None:
        os.killpg(_background_build.pid, signal.SIGTERM)
        _background_build.wait()


@pytest.fixture(scope="session")
def dev_cluster(tmp_path_factory) -> DevCluster:
    build = devcluster.build
    cached = all(build.is_fresh(build.paths_for(), name, build.KUBERNETES_VERSION)
                 for name in build.ALL_BINARIES)
    if not cached and shutil.which("go") is None:
        pytest.skip("Go is not installed: it is needed once to build kube-apiserver, "
                    "kube-scheduler, kube-controller-manager and etcd from the module proxy")
    devcluster.reap_orphaned_clusters()
    state_dir = tmp_path_factory.mktemp("dev-cluster")
    # Opt-in (needs CAP_NET_ADMIN): routable pod IPs, so Services get EndpointSlices.
    config = devcluster.ClusterConfig(state_dir=state_dir, node_count=2)
    ownership = devcluster.register_owner(state_dir, os.getpid())
    try:
        data = devcluster.start(config)  # stops what it started itself if it fails
        yield DevCluster(
            kubeconfig=Path(data["kubeconfig"]), api_url=data["api_url"], token=data["token"],
            bin_dir=Path(data["bin_dir"]), state_dir=state_dir, nodes=tuple(data["nodes"]),
            pod_network=ipaddress.ip_network(data["pod_cidr"]),
            api=devcluster.kubeapi.KubeApi(data["api_url"], data["token"]))
    finally:
        devcluster.stop(state_dir)
        ownership.unlink(missing_ok=True)


# The operator's e2e tests (test_operator_*.py): the chart installed once per session, a tiny
# model for the agents, a namespace per test. Loaded under its own name, so the test modules
# can `from operator_env import ...`.
operator_env = _load("operator_env", E2E_DIR / "operator_env.py")
tiny_model_dir = operator_env.tiny_model_dir
operator_release = operator_env.operator_release
sr_namespace = operator_env.sr_namespace
