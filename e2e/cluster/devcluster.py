"""Start, inspect and stop a real local Kubernetes control plane with fake GPU nodes.

The e2e tier's entry point (`make dev-cluster`, the `dev_cluster` pytest fixture). It builds
or reuses the binaries (`build.py`), then starts, each in its own session with its log under
the state dir: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the harness
kubelet (`../harness/kubelet.py`) that registers the fake GPU nodes and runs their pods as
local processes. Every pid goes into `state.json` as soon as it exists, so `stop` can end
exactly what `start` began, even after a failed start.

    python e2e/cluster/devcluster.py start [--nodes 2] [--state-dir DIR]
    python e2e/cluster/devcluster.py status | stop
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS_DIR = HERE.parent / "harness"


def _load(module_name: str, path: Path):
    """Load a sibling script as a module under a unique name (e2e/ is not a package)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


build = _load("slipstream_e2e_build", HERE / "build.py")
components = _load("slipstream_e2e_components", HERE / "components.py")
sys.path.insert(0, str(HARNESS_DIR))  # the harness modules import each other by plain name
kubeapi = _load("kubeapi", HARNESS_DIR / "kubeapi.py")
processes = _load("processes", HARNESS_DIR / "processes.py")


@dataclass(frozen=True)
class ClusterConfig:
    state_dir: Path
    node_count: int = 2
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    version: str = build.KUBERNETES_VERSION
    start_timeout_s: float = 180.0
    # None: pods get loopback IPs (no privileges needed, but EndpointSlices reject loopback).
    # A CIDR such as 10.244.0.0/16 is routed `local` to lo for the cluster's lifetime (needs
    # CAP_NET_ADMIN), so pod IPs are bindable *and* valid endpoint addresses.
    pod_cidr: str | None = None


def default_state_dir() -> Path:
    override = os.environ.get("SLIPSTREAM_DEV_CLUSTER_DIR")
    return Path(override) if override else build.default_cache_root() / "dev-cluster"


def log(message: str) -> None:
    print(f"[dev-cluster] {message}", file=sys.stderr, flush=True)



class StateFile:
    """state.json: everything `stop` and `status` need, written as soon as it is known."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "state.json"
        self.data: dict = json.loads(self.path.read_text()) if self.path.exists() else {}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)

    def record_process(self, name: str, process: subprocess.Popen, log_path: Path) -> None:
        self.data.setdefault("processes", []).append({
            "name": name, "pid": process.pid, "log": str(log_path),
            "start_time": processes.process_start_time(process.pid)})
        self.save()

    def alive(self) -> list[dict]:
        return [entry for entry in self.data.get("processes", [])
                if processes.is_same_process(entry["pid"], entry["start_time"])]


def spawn(state: StateFile, logs_dir: Path, name: str, argv: list[str],
          env: dict[str, str] | None = None) -> subprocess.Popen:
    log_path = logs_dir / f"{name}.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=env)
    state.record_process(name, process, log_path)
    log(f"started {name} (pid {process.pid})")
    return process


def wait_until(what: str, check, process: subprocess.Popen, log_path: Path,
               timeout_s: float) -> None:
    """Poll `check()` until true; fail early, with the log tail, if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what}: process exited with {process.returncode}; log:\n{tail}")
        try:
            if check():
                return
        except (OSError, ValueError, kubeapi.ApiError):
            pass
        time.sleep(0.25)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s; log:\n{tail}")


def https_ok(port: int, path: str, token: str | None = None) -> bool:
    api = kubeapi.KubeApi(f"https://127.0.0.1:{port}", token or "", timeout_s=3.0)
    connection = api._connection(3.0)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        return response.status == 200 and response.read().strip() == b"ok"
    finally:
        connection.close()


def etcd_healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as answer:
        return json.loads(answer.read()).get("health") == "true"


def make_service_account_keys(pki_dir: Path) -> None:
    subprocess.run(["openssl", "genrsa", "-out", str(pki_dir / "sa.key"), "2048"],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "rsa", "-in", str(pki_dir / "sa.key"), "-pubout",
                    "-out", str(pki_dir / "sa.pub")], check=True, capture_output=True)


def route_pod_cidr_locally(state: StateFile, cidr: str) -> None:
    """AnyIP: a `local` route makes every address of `cidr` bindable on this host.

    Only loopback ranges are accepted: test traffic must never be addressed to private or
    public ranges, even ones routed back to this host, on shared test machines.
    """
    import ipaddress

    if not ipaddress.ip_network(cidr).is_loopback:
        raise ValueError(f"pod CIDR {cidr} is not a loopback range (127.0.0.0/8); the dev "
                         "cluster only hands out loopback pod addresses")
    added = subprocess.run(["ip", "route", "add", "local", cidr, "dev", "lo"],
                           capture_output=True, text=True)
    if added.returncode != 0:
        raise RuntimeError(f"cannot route pod CIDR {cidr} to lo ({added.stderr.strip()}); "
                           "this needs CAP_NET_ADMIN and a CIDR no other cluster uses. Leave "
                           "--pod-cidr unset to give pods loopback addresses instead.")
    state.data["pod_cidr_route"] = cidr
    state.save()


def cluster_ready(api, node_names: list[str]) -> bool:
    """All fake nodes Ready and without the not-ready taint, and pods admissible in
    `default` (its ServiceAccount exists)."""
    for name in node_names:
        node = api.get(f"/api/v1/nodes/{name}")
        ready = any(c["type"] == "Ready" and c["status"] == "True"
                    for c in node["status"].get("conditions", []))
        tainted = any(t["key"].startswith("node.kubernetes.io/")
                      for t in node["spec"].get("taints") or [])
        if not ready or tainted:
            return False
    return api.get("/api/v1/namespaces/default/serviceaccounts/default", ok_missing=True) is not None


def start(config: ClusterConfig) -> dict:
    """Start the whole cluster; return the state (kubeconfig, api_url, pids...)."""
    state_dir = config.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = StateFile(state_dir)
    if existing.data.get("processes"):
        if len(existing.alive()) == len(existing.data["processes"]):
            log(f"already running; kubeconfig {existing.data['kubeconfig']}")
            return existing.data
        log("found a half-dead cluster from an earlier run; stopping it first")
        stop(state_dir)
    bin_dir = build.ensure_binaries(config.version)
    for sub in ("pki", "logs", "pods"):
        shutil.rmtree(state_dir / sub, ignore_errors=True)
        (state_dir / sub).mkdir(parents=True)
    pki_dir, logs_dir = state_dir / "pki", state_dir / "logs"
    state = StateFile(state_dir)
    state.data = {"version": config.version, "bin_dir": str(bin_dir), "processes": [],
                  "etcd_data_dir": tempfile.mkdtemp(prefix="slipstream-etcd-")}
    state.save()
    try:
        return _start_processes(config, state, bin_dir, pki_dir, logs_dir)
    except BaseException:
        log("start failed; stopping what was started")
        stop(state_dir)
        raise


def _start_processes(config: ClusterConfig, state: StateFile, bin_dir: Path, pki_dir: Path,
                     logs_dir: Path) -> dict:
    state_dir, timeout_s = config.state_dir, config.start_timeout_s
    started = time.monotonic()
    make_service_account_keys(pki_dir)
    identities = components.make_identities()
    token_file = pki_dir / "tokens.csv"
    token_file.write_text(components.token_file_text(identities))
    # Here, not at the top: `status` and `stop` run on a Python without slipstream installed.
    from slipstream.agent.parallel.launch import free_port

    ports = components.Ports(*(free_port() for _ in range(5)))
    server = f"https://127.0.0.1:{ports.apiserver}"
    kubeconfigs = {}
    for key, identity in identities.items():
        path = state_dir / f"{identity.file_stem}.kubeconfig"
        path.write_text(components.kubeconfig_text(server, identity))
        path.chmod(0o600)
        kubeconfigs[key] = path
    (pki_dir / "harness-kubelet.token").write_text(identities["harness-kubelet"].token)
    state.data.update(api_url=server, kubeconfig=str(kubeconfigs["admin"]),
                      token=identities["admin"].token, ports=ports.__dict__)
    state.save()

    etcd = spawn(state, logs_dir, "etcd",
                 components.etcd_argv(bin_dir, Path(state.data["etcd_data_dir"]), ports))
    wait_until("etcd", lambda: etcd_healthy(ports.etcd_client), etcd, logs_dir / "etcd.log",
               timeout_s)
    apiserver = spawn(state, logs_dir, "kube-apiserver",
                      components.apiserver_argv(bin_dir, pki_dir, token_file, ports))
    wait_until("kube-apiserver", lambda: https_ok(ports.apiserver, "/readyz",
                                                  identities["admin"].token),
               apiserver, logs_dir / "kube-apiserver.log", timeout_s)
    manager = spawn(state, logs_dir, "kube-controller-manager", components.controller_manager_argv(
        bin_dir, pki_dir, kubeconfigs["kube-controller-manager"], ports))
    scheduler = spawn(state, logs_dir, "kube-scheduler", components.scheduler_argv(
        bin_dir, pki_dir, kubeconfigs["kube-scheduler"], ports))
    if config.pod_cidr:
        route_pod_cidr_locally(state, config.pod_cidr)
    pod_cidr = config.pod_cidr or \
        f"127.{random.Random().randint(64, 254)}.0.0/16"  # distinct clusters rarely clash
    harness = spawn(state, logs_dir, "harness-kubelet", components.harness_kubelet_argv(
        sys.executable, HARNESS_DIR, bin_dir, server, pki_dir / "harness-kubelet.token",
        state_dir,
        config.node_count, config.gpus_per_node, config.gpu_product, pod_cidr,
        f"v{config.version}"))
    wait_until("kube-controller-manager", lambda: https_ok(ports.controller_manager, "/healthz"),
               manager, logs_dir / "kube-controller-manager.log", timeout_s)
    wait_until("kube-scheduler", lambda: https_ok(ports.scheduler, "/healthz"),
               scheduler, logs_dir / "kube-scheduler.log", timeout_s)
    api = kubeapi.KubeApi(server, identities["admin"].token)
    node_names = [f"gpu-node-{index}" for index in range(config.node_count)]
    wait_until("fake GPU nodes", lambda: cluster_ready(api, node_names), harness,
               logs_dir / "harness-kubelet.log", timeout_s)
    state.data.update(nodes=node_names, pod_cidr=pod_cidr,
                      started_at=time.time())
    state.save()
    log(f"ready in {time.monotonic() - started:.1f} s: {server}, nodes {', '.join(node_names)}")
    return state.data


def stop(state_dir: Path) -> list[str]:
    """Kill every recorded process (pod processes first), newest first; return their names."""
    state = StateFile(state_dir)
    stopped = []
    for entry in reversed(state.data.get("processes", [])):
        # The harness kubelet stops its pods itself on SIGTERM; give it time to.
        grace_s = 15.0 if entry["name"] == "harness-kubelet" else 5.0
        if processes.kill_recorded(entry["pid"], entry["start_time"], grace_s):
            stopped.append(f"{entry['name']} ({entry['pid']})")
    for pid_file in sorted((state_dir / "pods").glob("*/pid.json")):
        record = json.loads(pid_file.read_text())
        if processes.kill_recorded(record["pid"], record["start_time"], 2.0):
            stopped.append(f"pod {record['pod']} ({record['pid']})")
        pid_file.unlink(missing_ok=True)
    if state.data.get("pod_cidr_route"):
        subprocess.run(["ip", "route", "del", "local", state.data["pod_cidr_route"], "dev", "lo"],
                       capture_output=True)
        stopped.append(f"route local {state.data['pod_cidr_route']}")
    data_dir = state.data.get("etcd_data_dir")
    if data_dir and Path(data_dir).name.startswith("slipstream-etcd-"):
        shutil.rmtree(data_dir, ignore_errors=True)
    state.path.unlink(missing_ok=True)
    return stopped


def sessions_dir() -> Path:
    return build.default_cache_root() / "dev-cluster-sessions"


def register_owner(state_dir: Path, owner_pid: int) -> Path:
    """Note that `owner_pid` (a test session) owns the cluster in `state_dir`, so a later
    session can stop it if the owner was killed before it could."""
    sessions_dir().mkdir(parents=True, exist_ok=True)
    entry = sessions_dir() / f"{owner_pid}-{time.time_ns()}.json"
    entry.write_text(json.dumps({"state_dir": str(state_dir), "owner_pid": owner_pid,
                                 "owner_start_time": processes.process_start_time(owner_pid)}))
    return entry


def reap_orphaned_clusters() -> list[str]:
    """Stop clusters whose owning test session died without stopping them."""
    stopped = []
    for entry in sorted(sessions_dir().glob("*.json")) if sessions_dir().exists() else []:
        try:
            record = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if processes.is_same_process(record["owner_pid"], record["owner_start_time"]):
            continue
        stopped += stop(Path(record["state_dir"]))
        entry.unlink(missing_ok=True)
    if stopped:
        log("stopped processes of a dead test session: " + ", ".join(stopped))
    return stopped


def status(state_dir: Path) -> int:
    state = StateFile(state_dir)
    if not state.data.get("processes"):
        print("not running")
        return 1
    alive = {entry["pid"] for entry in state.alive()}
    print(f"api:        {state.data.get('api_url')}")
    print(f"kubeconfig: {state.data.get('kubeconfig')}")
    for entry in state.data["processes"]:
        mark = "running" if entry["pid"] in alive else "DEAD"
        print(f"  {entry['name']:<24} pid {entry['pid']:<8} {mark}   log {entry['log']}")
    return 0 if len(alive) == len(state.data["processes"]) else 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("start", "stop", "status"))
    parser.add_argument("--state-dir", type=Path, default=default_state_dir(),
                        help="kubeconfigs, logs, pid files (default %(default)s)")
    parser.add_argument("--nodes", type=int, default=2, help="fake GPU nodes to create")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-product", default=ClusterConfig.gpu_product)
    parser.add_argument("--pod-cidr", default=None,
                        help="give pods IPs from this CIDR, routed `local` to lo while the "
                             "cluster runs (needs CAP_NET_ADMIN; EndpointSlices then work). "
                             "Default: a random 127.N.0.0/16 (no privileges; loopback pod IPs "
                             "are rejected in EndpointSlices)")
    args = parser.parse_args(argv)
    state_dir = args.state_dir.expanduser().resolve()
    if args.command == "start":
        data = start(ClusterConfig(state_dir, args.nodes, args.gpus_per_node, args.gpu_product,
                                   pod_cidr=args.pod_cidr))
        print(data["kubeconfig"])
        return 0
    if args.command == "stop":
        stopped = stop(state_dir)
        log("stopped " + (", ".join(stopped) if stopped else "nothing (no live processes)"))
        return 0
    return status(state_dir)


if __name__ == "__main__":
    sys.exit(main())
