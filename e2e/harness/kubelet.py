"""A test-harness kubelet: runs pods bound to the fake GPU nodes as local processes.

Where it sits: kube-scheduler binds pods to the fake nodes (`nodes.py`); this loop sees them,
gives each a loopback pod IP (127.A.x.y), starts its first container's command with the pod's
env (`podenv.py`), probes it (`probes.py`) and writes its status (`podstatus.py`). It restarts
per restartPolicy with back-off and, when a pod is deleted, kills its process group and then
removes the pod object. Every process goes in its own session, recorded in a pid file, so the
dev-cluster launcher can kill leftovers even if this process dies. Real clusters use kubelet.

    python e2e/harness/kubelet.py --server URL --token-file F --state-dir D --nodes 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import nodes
import podenv
import podstatus
from kubeapi import ApiError, JSON, KubeApi
from logserver import start_log_server
from probes import ProbeTracker, run_probe
from processes import kill_process_group, process_start_time

HEARTBEAT_PERIOD_S = 10.0
RESYNC_PERIOD_S = 2.0
LOOP_PERIOD_S = 0.2
BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0
TOKEN_LIFETIME_S = 24 * 3600


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} kubelet: {message}", file=sys.stderr, flush=True)


@dataclass
class PodRuntime:
    """One pod on one fake node: its API object, its process and its probes."""

    pod: JSON
    run: podstatus.ContainerRun
    pod_dir: Path
    log_path: Path
    process: subprocess.Popen | None = None
    launch: podenv.Launch | None = None
    next_start_s: float = 0.0
    backoff_s: float = BACKOFF_INITIAL_S
    started_mono_s: float = 0.0
    probes: dict[str, ProbeTracker] = field(default_factory=dict)
    probes_in_flight: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    terminating: bool = False
    gone: bool = False
    last_status: JSON | None = None
    cwd: Path | None = None

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    @property
    def container(self) -> JSON:
        return self.pod["spec"]["containers"][0]


class Kubelet:
    def __init__(self, api: KubeApi, node_names: list[str], state_dir: Path, pod_cidr: str,
                 node_spec: nodes.FakeNodeSpec, path_prepend: list[str]):
        self.api = api
        self.node_names = set(node_names)
        self.ordered_nodes = node_names
        self.state_dir = state_dir
        self.pod_network = ipaddress.ip_network(pod_cidr)
        self.node_spec = node_spec
        self.runtimes: dict[str, PodRuntime] = {}
        self.used_ips: set[str] = set()
        self.next_ip_index = 0
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.prober = concurrent.futures.ThreadPoolExecutor(max_workers=8)
        self.kubelet_port = 0  # the `kubectl logs` endpoint, set when run() starts it
        base_env = dict(os.environ)
        base_env["PATH"] = os.pathsep.join([*path_prepend, base_env.get("PATH", "")])
        self.base_env = base_env

    # ---- addresses -------------------------------------------------------------------
    def allocate_ip(self) -> str:
        host_count = self.pod_network.num_addresses - 2
        for _ in range(host_count):
            index, self.next_ip_index = self.next_ip_index, (self.next_ip_index + 1) % host_count
            address = str(self.pod_network[index + 1])
            if address not in self.used_ips:
                self.used_ips.add(address)
                return address
        raise RuntimeError(f"pod network {self.pod_network} is full")

    # ---- pod set ---------------------------------------------------------------------
    def list_my_pods(self) -> list[JSON]:
        listing = self.api.get("/api/v1/pods", query={"fieldSelector": "spec.nodeName!="})
        return [pod for pod in listing["items"] if pod["spec"].get("nodeName") in self.node_names]

    def sync(self, pods: list[JSON]) -> None:
        seen = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            runtime = self.runtimes.get(uid)
            if runtime is None:
                if pod["status"].get("phase") in ("Succeeded", "Failed") and \
                        not pod["metadata"].get("deletionTimestamp"):
                    continue  # finished before this harness started; leave it be
                runtime = self.runtimes[uid] = self.new_runtime(pod)
                log(f"pod {runtime.key} assigned {runtime.run.pod_ip}")
            runtime.pod = pod
            if pod["metadata"].get("deletionTimestamp") and not runtime.terminating:
                self.begin_termination(runtime)
        for uid, runtime in list(self.runtimes.items()):
            if uid not in seen and not runtime.terminating:
                # Deleted with grace 0 by someone else: the process must still go.
                runtime.terminating = True
                threading.Thread(target=self.kill_runtime, args=(runtime, 0.0), daemon=True).start()

    def new_runtime(self, pod: JSON) -> PodRuntime:
        meta = pod["metadata"]
        container = pod["spec"]["containers"][0]
        pod_dir = self.state_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        run = podstatus.ContainerRun(container_name=container["name"],
                                     image=container.get("image", ""),
                                     pod_ip=self.allocate_ip(), created_at_s=time.time())
        log_path = self.state_dir / "logs" / f"{meta['namespace']}_{meta['name']}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        return PodRuntime(pod=pod, run=run, pod_dir=pod_dir, log_path=log_path)

    # ---- process lifecycle -----------------------------------------------------------
    def service_account_env(self, runtime: PodRuntime) -> dict[str, str]:
        """A kubeconfig with a bound token of the pod's service account (in-cluster creds)."""
        spec, meta = runtime.pod["spec"], runtime.pod["metadata"]
        if spec.get("automountServiceAccountToken") is False:
            return {}
        account = spec.get("serviceAccountName") or "default"
        answer = self.api.post(
            f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": TOKEN_LIFETIME_S,
                      "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                         "name": meta["name"], "uid": meta["uid"]}}})
        kubeconfig = runtime.pod_dir / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
            "clusters": [{"name": "local", "cluster": {"server": self.api.server,
                                                        "insecure-skip-tls-verify": True}}],
            "users": [{"name": account, "user": {"token": answer["status"]["token"]}}],
            "contexts": [{"name": "in-cluster", "context": {
                "cluster": "local", "user": account, "namespace": meta["namespace"]}}],
        }, indent=1))
        return {"KUBECONFIG": str(kubeconfig)}

    def start(self, runtime: PodRuntime, now_s: float) -> None:
        run = runtime.run
        try:
            launch = podenv.build_launch(self.api, runtime.pod, run.pod_ip, self.base_env,
                                         self.service_account_env(runtime),
                                         runtime.pod_dir / "volumes")
        except (podenv.PodSpecError, ApiError) as error:
            run.waiting_reason, run.waiting_message = "CreateContainerConfigError", str(error)
            runtime.next_start_s = now_s + 2.0
            return
        runtime.cwd = Path(launch.working_dir) if launch.working_dir and \
            Path(launch.working_dir).is_dir() else runtime.pod_dir
        try:
            with open(runtime.log_path, "ab") as log_file:  # the child keeps its own copy
                runtime.process = subprocess.Popen(
                    launch.argv, env=launch.env, cwd=runtime.cwd, stdin=subprocess.DEVNULL,
                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as error:
            run.waiting_reason, run.waiting_message = "RunContainerError", str(error)
            self.schedule_restart(runtime, now_s, exit_code=127)
            return
        pid = runtime.process.pid
        if run.last_termination is not None:
            run.restart_count += 1  # kubelet counts restarts, not exits
        (runtime.pod_dir / "pid.json").write_text(json.dumps(
            {"pid": pid, "start_time": process_start_time(pid), "pod": runtime.key}))
        runtime.launch = launch
        runtime.started_mono_s = now_s
        run.pid, run.running_since_s, run.waiting_reason, run.waiting_message = \
            pid, time.time(), None, ""
        run.ready = False
        container = runtime.container
        runtime.probes = {kind: ProbeTracker(container[f"{kind}Probe"], now_s)
                          for kind in ("startup", "readiness", "liveness")
                          if container.get(f"{kind}Probe")}
        log(f"pod {runtime.key} started pid {pid}: {' '.join(launch.argv)}")

    def schedule_restart(self, runtime: PodRuntime, now_s: float, exit_code: int) -> None:
        """After an exit, restart per restartPolicy with exponential back-off, or finish."""
        policy = runtime.pod["spec"].get("restartPolicy", "Always")
        if policy == "Never" or (policy == "OnFailure" and exit_code == 0):
            runtime.run.finished_phase = "Succeeded" if exit_code == 0 else "Failed"
            log(f"pod {runtime.key} finished: {runtime.run.finished_phase} (exit {exit_code})")
            return
        if now_s - runtime.started_mono_s > BACKOFF_RESET_AFTER_S:
            runtime.backoff_s = BACKOFF_INITIAL_S
        runtime.next_start_s = now_s + runtime.backoff_s
        runtime.backoff_s = min(runtime.backoff_s * 2, BACKOFF_MAX_S)
        runtime.run.waiting_reason = "CrashLoopBackOff"
        runtime.run.waiting_message = f"back-off restarting (exit {exit_code})"

    def reap(self, runtime: PodRuntime, now_s: float) -> None:
        exit_code = runtime.process.poll() if runtime.process else None
        if exit_code is None:
            return
        run = runtime.run
        run.last_termination = podstatus.termination_record(
            exit_code, run.running_since_s or time.time(), time.time(), run.pid or 0)
        log(f"pod {runtime.key} pid {run.pid} exited with {exit_code}")
        runtime.process, run.pid, run.running_since_s, run.ready = None, None, None, False
        runtime.probes, runtime.probes_in_flight = {}, {}
        self.schedule_restart(runtime, now_s, exit_code)

    def step_probes(self, runtime: PodRuntime, now_s: float) -> None:
        for kind, future in list(runtime.probes_in_flight.items()):
            if future.done():
                del runtime.probes_in_flight[kind]
                if kind in runtime.probes:
                    runtime.probes[kind].record(future.result(), now_s)
        startup = runtime.probes.get("startup")
        gated = ["startup"] if startup is not None and not startup.passing else \
            ["readiness", "liveness"]
        for kind in gated:
            tracker = runtime.probes.get(kind)
            if tracker is None or kind in runtime.probes_in_flight or not tracker.due(now_s):
                continue
            runtime.probes_in_flight[kind] = self.prober.submit(
                run_probe, tracker.probe, runtime.container, runtime.run.pod_ip,
                runtime.launch.env if runtime.launch else self.base_env, str(runtime.cwd))
        readiness = runtime.probes.get("readiness")
        started = startup is None or startup.passing
        runtime.run.ready = started and (readiness is None or readiness.passing)
        for kind in ("startup", "liveness"):
            tracker = runtime.probes.get(kind)
            if tracker is not None and tracker.failed_out and runtime.process is not None:
                log(f"pod {runtime.key} failed its {kind} probe; killing it")
                tracker.consecutive_failures = 0
                # Off the loop thread: the loop reaps the exit and restarts per restartPolicy.
                threading.Thread(target=kill_process_group, daemon=True,
                                 args=(runtime.process.pid, self.grace_s(runtime))).start()

    def step(self, runtime: PodRuntime, now_s: float) -> None:
        if runtime.terminating or runtime.run.finished_phase is not None:
            return
        if runtime.process is None:
            if now_s >= runtime.next_start_s:
                self.start(runtime, now_s)
            return
        self.reap(runtime, now_s)
        if runtime.process is not None:
            self.step_probes(runtime, now_s)

    def push_status(self, runtime: PodRuntime, now_s: float) -> None:
        if runtime.terminating:
            return
        status = podstatus.build_pod_status(runtime.run, now_s)
        if status == runtime.last_status:
            return
        meta = runtime.pod["metadata"]
        try:
            self.api.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                           {"metadata": {"uid": meta["uid"]}, "status": status})
            runtime.last_status = status
        except ApiError as error:
            if error.status not in (404, 409, 422):
                raise

    # ---- deletion --------------------------------------------------------------------
    @staticmethod
    def grace_s(runtime: PodRuntime) -> float:
        meta = runtime.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = runtime.pod["spec"].get("terminationGracePeriodSeconds", 30)
        return float(min(grace, 30))

    def begin_termination(self, runtime: PodRuntime) -> None:
        runtime.terminating = True
        log(f"pod {runtime.key} is being deleted; stopping pid {runtime.run.pid}")
        threading.Thread(target=self.kill_runtime, args=(runtime, self.grace_s(runtime)),
                         daemon=True).start()

    def kill_runtime(self, runtime: PodRuntime, grace_s: float) -> None:
        """Kill the pod's process group, then remove the pod object for good (grace 0)."""
        if runtime.process is not None:
            kill_process_group(runtime.process.pid, grace_s, runtime.process)
        (runtime.pod_dir / "pid.json").unlink(missing_ok=True)
        meta = runtime.pod["metadata"]
        try:
            self.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                            {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                             "preconditions": {"uid": meta["uid"]}})
        except ApiError as error:
            if error.status != 409:  # 409: a newer pod of the same name; not ours to delete
                log(f"pod {runtime.key}: final delete failed: {error}")
        runtime.gone = True
        self.wake.set()

    def shutdown(self) -> None:
        for runtime in list(self.runtimes.values()):
            if runtime.process is not None:
                kill_process_group(runtime.process.pid, 5.0, runtime.process)
            (runtime.pod_dir / "pid.json").unlink(missing_ok=True)
        self.prober.shutdown(wait=False, cancel_futures=True)

    # ---- loops -----------------------------------------------------------------------
    def heartbeat_loop(self) -> None:
        while not self.stopping.is_set():
            for name in self.ordered_nodes:
                try:
                    nodes.heartbeat_node(self.api, name)
                except (ApiError, OSError) as error:
                    if isinstance(error, ApiError) and error.status == 404:
                        nodes.register_node(self.api, name, self.ordered_nodes.index(name),
                                            self.node_spec, self.kubelet_port)
                    else:
                        log(f"heartbeat of {name} failed: {error}")
            self.stopping.wait(HEARTBEAT_PERIOD_S)

    def watch_loop(self) -> None:
        """Wakes the main loop on every pod change; the main loop re-lists, so a lost event
        only costs up to RESYNC_PERIOD_S."""
        while not self.stopping.is_set():
            try:
                listing = self.api.get("/api/v1/pods", query={"limit": "1"})
                for _ in self.api.watch("/api/v1/pods", listing["metadata"]["resourceVersion"],
                                        query={"fieldSelector": "spec.nodeName!="}):
                    self.wake.set()
                    if self.stopping.is_set():
                        return
            except (ApiError, OSError, ValueError) as error:
                log(f"pod watch restarting: {error}")
                self.stopping.wait(1.0)

    def pod_running(self, namespace: str, name: str) -> bool:
        return any(r.key == f"{namespace}/{name}" and r.process is not None and not r.terminating
                   for r in list(self.runtimes.values()))

    def run(self) -> None:
        self.kubelet_port = start_log_server(self.state_dir / "logs",
                                             self.state_dir / "pki" / "harness-kubelet",
                                             self.pod_running)
        for index, name in enumerate(self.ordered_nodes):
            nodes.register_node(self.api, name, index, self.node_spec, self.kubelet_port)
        log(f"registered nodes {', '.join(self.ordered_nodes)}")
        for loop in (self.heartbeat_loop, self.watch_loop):
            threading.Thread(target=loop, daemon=True).start()
        last_list_s = 0.0
        while not self.stopping.is_set():
            woke = self.wake.wait(LOOP_PERIOD_S)
            self.wake.clear()
            now_s = time.monotonic()
            try:
                if woke or now_s - last_list_s > RESYNC_PERIOD_S:
                    self.sync(self.list_my_pods())
                    last_list_s = now_s
                for uid, runtime in list(self.runtimes.items()):
                    if runtime.gone:
                        self.used_ips.discard(runtime.run.pod_ip)
                        del self.runtimes[uid]
                        continue
                    self.step(runtime, now_s)
                    self.push_status(runtime, now_s)
            except Exception as error:  # the harness must outlive one odd pod or API hiccup
                log(f"loop error (retrying): {error!r}\n{traceback.format_exc()}")
                time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run pods bound to fake GPU nodes as local "
                                                 "processes (e2e test harness, not a kubelet).")
    parser.add_argument("--server", required=True, help="API server URL")
    parser.add_argument("--token-file", required=True, type=Path, help="bearer token file")
    parser.add_argument("--state-dir", required=True, type=Path,
                        help="pod logs, pid files and per-pod kubeconfigs go here")
    parser.add_argument("--nodes", type=int, default=2, help="number of fake GPU nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-product", default=nodes.FakeNodeSpec.gpu_product)
    parser.add_argument("--kubelet-version", default=nodes.FakeNodeSpec.kubelet_version)
    parser.add_argument("--pod-cidr", default="127.100.0.0/16",
                        help="pod IPs come from here; it must be local to this host (a part of "
                             "127.0.0.0/8, or a range routed `local` to lo)"),
    parser.add_argument("--path-prepend", action="append", default=[],
                        help="directories put first on PATH for pod processes")
    args = parser.parse_args(argv)
    api = KubeApi(args.server, args.token_file.read_text().strip())
    spec = nodes.FakeNodeSpec(gpus_per_node=args.gpus_per_node, gpu_product=args.gpu_product,
                              kubelet_version=args.kubelet_version)
    kubelet = Kubelet(api, [nodes.node_name(i) for i in range(args.nodes)], args.state_dir,
                      args.pod_cidr, spec, [*args.path_prepend, str(Path(sys.executable).parent)])

    def stop(signum: int, _frame: object) -> None:
        kubelet.stopping.set()
        kubelet.wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        kubelet.run()
    finally:
        kubelet.shutdown()
        log("stopped; all pod processes killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
