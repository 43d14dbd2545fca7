"""Fixtures and helpers of the operator e2e tests (loaded by e2e/conftest.py).

    dev_cluster (conftest) --helm install charts/slipstream--> operator Deployment
      --harness kubelet--> `slipstream operator` as a local process with the chart's
      ServiceAccount token --> ServingReplicas applied by the tests --> agent pods that run
      real `slipstream serve` on a tiny model, bound to 127.x pod IPs

Services have no virtual IPs here (no kube-proxy), so clients talk to an instance's rank-0
pod IP, which is what the client Service would route to.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from slipstream.bench import local_process
from slipstream.agent.parallel.launch import free_port

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "slipstream"
OPERATOR_NAMESPACE = "slipstream-system"
RELEASE = "slipstream"
REPLICA_LABEL = "slipstream.dev/replica"
POOL_LABEL = "slipstream.dev/pool"
READY_TIMEOUT_S = 180.0
OPERATOR_METRICS_PORT = 8080
# Series the operator exports only for a replica with spec.autoscaling: the observability
# e2e (no autoscaling there, it would fight the rebalance move) leaves them out by name, and
# the autoscaler's e2e checks exactly these panels.
AUTOSCALING_SERIES = re.compile(
    r"slipstream_operator_(desired_instances|current_instances|max_instances"
    r"|scale_decisions_total|drains_total)\b")


@dataclass(frozen=True)
class OperatorRelease:
    namespace: str
    deployment: str
    service_account: str


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight model on the "host", served by every agent through hostPath."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, "-m", "slipstream.cli", "make-tiny-model", str(path)],
                   check=True, capture_output=True, timeout=300)
    return path


@pytest.fixture(scope="session")
def operator_release(dev_cluster) -> OperatorRelease:
    """The chart, installed once per session; the operator runs as its Deployment's pod."""
    dev_cluster.helm("install", RELEASE, str(CHART), "--namespace", OPERATOR_NAMESPACE,
                     "--create-namespace", "--wait", "--timeout", "180s", timeout_s=240)
    release = OperatorRelease(namespace=OPERATOR_NAMESPACE,
                              deployment=f"{RELEASE}-operator",
                              service_account=f"{RELEASE}-operator")
    dev_cluster.wait_for(lambda: operator_pods(dev_cluster, release, ready=True), 120,
                         "the operator pod Ready")
    yield release
    dev_cluster.helm("uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE, "--wait",
                     check=False)


@pytest.fixture
def sr_namespace(dev_cluster, operator_release) -> str:
    name = f"sr-{uuid.uuid4().hex[:8]}"
    dev_cluster.create_namespace(name)
    yield name
    dev_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    # The next test counts free GPUs: this namespace's pods must be gone first, not merely
    # marked for deletion (on a loaded machine their processes take a while to stop).
    dev_cluster.wait_for(lambda: not namespace_pods(dev_cluster, name), 180,
                         f"the pods of namespace {name} to be deleted")


def namespace_pods(cluster, namespace: str) -> list[dict]:
    return cluster.api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]


# -- helpers ------------------------------------------------------------------------------------

def operator_pods(cluster, release: OperatorRelease, ready: bool = False) -> list[dict]:
    pods = cluster.api.get(f"/api/v1/namespaces/{release.namespace}/pods",
                           query={"labelSelector": "app.kubernetes.io/name=slipstream-operator"})
    items = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    return [p for p in items if is_ready(p)] if ready else items


def is_ready(pod: dict | None) -> bool:
    return bool(pod) and any(c["type"] == "Ready" and c["status"] == "True"
                             for c in (pod.get("status") or {}).get("conditions", []))


def servingreplica(name: str, namespace: str, model_dir: Path, *, instances: int = 2,
                   tp: int = 1, **spec_extra) -> dict:
    """A spec for the tiny model (4 heads, 2 KV heads, 4 layers: tp <= 2, spp <= 4). Each
    "GPU" is one worker process of the agent, so small instances keep the e2e tier light."""
    spec = {"model": {"name": "tiny", "source": {"hostPath": {"path": str(model_dir)}}},
            "image": "slipstream-agent:e2e", "instances": instances,
            "parallelism": {"tp": tp}, "placement": {"gpusPerNode": 8}, **spec_extra}
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "ServingReplica",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def get_replica(cluster, namespace: str, name: str) -> dict | None:
    return cluster.api.get(
        f"/apis/slipstream.dev/v1alpha1/namespaces/{namespace}/servingreplicas/{name}",
        ok_missing=True)


def replica_pods(cluster, namespace: str, name: str, *, live: bool = True) -> list[dict]:
    pods = cluster.api.get(f"/api/v1/namespaces/{namespace}/pods",
                           query={"labelSelector": f"{REPLICA_LABEL}={name}"})["items"]
    if live:
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def condition(replica: dict, kind: str) -> dict | None:
    return next((c for c in (replica.get("status") or {}).get("conditions", [])
                 if c["type"] == kind), None)


def wait_ready(cluster, namespace: str, name: str, expected: str,
               timeout_s: float = READY_TIMEOUT_S) -> dict:
    """Wait until status.ready shows ``expected`` (like "2/2") with phase Ready."""
    def ready():
        replica = get_replica(cluster, namespace, name)
        status = (replica or {}).get("status") or {}
        return replica if status.get("ready") == expected and status.get("phase") == "Ready" \
            else None
    return cluster.wait_for(ready, timeout_s, f"{name} Ready {expected}")


def pod_ip(pod: dict) -> str:
    return pod["status"]["podIP"]


def client_for(pod: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{pod_ip(pod)}:8000/v1", api_key="unused",
                         max_retries=0, timeout=60)


def complete(pod: dict, prompt: str = "Hello", max_tokens: int = 4) -> str:
    answer = client_for(pod).completions.create(model="tiny", prompt=prompt,
                                                max_tokens=max_tokens)
    assert answer.choices[0].finish_reason in ("length", "stop")
    return answer.choices[0].text


def events(cluster, namespace: str, reason: str) -> list[dict]:
    items = cluster.api.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return [e for e in items if e.get("reason") == reason]


def operator_kubeconfig(cluster, release: OperatorRelease) -> Path:
    """The credentials the running operator process really uses (from its environment)."""
    pod = operator_pods(cluster, release, ready=True)[0]
    meta = pod["metadata"]
    pod_dir = cluster.state_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
    pid = json.loads((pod_dir / "pid.json").read_text())["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    values = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
    return Path(values["KUBECONFIG"])


def operator_metric(cluster, release: OperatorRelease, name: str) -> list[tuple[dict, float]]:
    """Samples of one metric from the operator's /metrics (at its pod IP)."""
    from prometheus_client.parser import text_string_to_metric_families
    import urllib.request

    ip = operator_pods(cluster, release, ready=True)[0]["status"]["podIP"]
    text = urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=10).read().decode()
    return [(sample.labels, sample.value) for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name]


@contextlib.contextmanager
def router_process(cluster, namespace: str, replica: str, log_path: Path,
                   *flags: str) -> Iterator[str]:
    """`slipstream router` on 127.0.0.1, finding the replica's controller pods through the pod
    list; yields its ``host:port``."""
    port = free_port()
    env = {**cluster.env, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("POD_IP", None)
    argv = [sys.executable, "-m", "slipstream.cli", "router", "--namespace", namespace,
            "--selector", f"slipstream.dev/replica={replica},slipstream.dev/role=controller",
            "--kubeconfig", str(cluster.kubeconfig), "--host", "127.0.0.1",
            "--port", str(port), *flags]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        local_process.stop(process, grace_s=15)


@contextlib.contextmanager
def prometheus_scraping(workdir: Path, targets_by_job: dict[str, list[str]]):
    """A real Prometheus (Debian's binary, with the chart's rules) scraping fixed loopback
    targets per job, every second; yields its live_prometheus.PrometheusServer once every
    target is up."""
    if str(REPO / "charts") not in sys.path:
        sys.path.insert(0, str(REPO / "charts"))
    from dashgen import live_prometheus  # dashgen lives beside the chart

    binary = live_prometheus.binary()
    if binary is None:
        pytest.skip("prometheus not installed (make test installs Debian's prometheus package)")
    workdir.mkdir(parents=True, exist_ok=True)
    server = live_prometheus.PrometheusServer(workdir, targets_by_job)
    try:
        server.start(binary)
        for job in targets_by_job:
            every = f'count(up{{job="{job}"}} == 1) == {len(targets_by_job[job])}'
            assert server.wait_for(every, timeout_s=20), f"{job}: not every target scraped"
        yield server
    finally:
        server.stop()


def timed(what: str):
    """A context manager printing how long ``what`` took (figures for the report)."""
    class _Timer:
        def __enter__(self):
            self.start = time.monotonic()
            return self

        def __exit__(self, *_):
            self.elapsed_s = time.monotonic() - self.start
            print(f"[measure] {what}: {self.elapsed_s:.2f} s", file=sys.stderr)
    return _Timer()


class ClosedLoopLoad:
    """``clients`` threads that each call ``one_request(client_index, turn)`` back to back
    (with ``pause_s`` between turns) until the block ends, counting what succeeded, what
    failed and which backends answered (whatever non-None ``one_request`` returned).
    ``one_request`` returns ``NOTHING_SENT`` when it sent no request (nothing is counted)."""

    NOTHING_SENT = object()

    def __init__(self, clients: int, one_request: Callable[[int, int], object],
                 pause_s: float = 0.0) -> None:
        self.one_request, self.pause_s = one_request, pause_s
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.served_by: set[str] = set()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(clients)]

    def __enter__(self) -> ClosedLoopLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, k: int) -> None:
        turn = 0
        while not self.stop.is_set():
            try:
                backend = self.one_request(k, turn)
            except Exception as error:  # noqa: BLE001 - recorded, asserted on
                with self.lock:
                    self.failures.append(repr(error))
            else:
                if backend is self.NOTHING_SENT:
                    continue
                with self.lock:
                    self.ok += 1
                    if isinstance(backend, str):
                        self.served_by.add(backend)
            turn += 1
            self.stop.wait(self.pause_s)
