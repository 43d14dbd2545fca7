"""``slipstream router`` against the real local control plane: it finds agent pods by label
through a real list and watch, and relabelling a pod's ``slipstream.dev/pool`` (what the
operator's rebalancer does) changes routing within one watch event, with no restart.

The pods run a stand-in agent (stdlib HTTP, answering with its own pod name), so that the test
measures membership and routing, not model start-up.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import pytest

from operator_env import router_process

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
THRESHOLD_TOKENS = 16
LONG_PROMPT = "x" * 400  # about 100 tokens by the router's estimate without a tokenizer
FAKE_AGENT = """
import json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
NAME = os.environ["POD_NAME"]
class Handler(BaseHTTPRequestHandler):
    def _send(self, body, kind="application/json"):
        data = body.encode()
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send("" if self.path == "/metrics" else json.dumps({"status": "ok"}),
                   "text/plain" if self.path == "/metrics" else "application/json")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(json.dumps({"object": "text_completion", "served_by": NAME,
                               "choices": [{"index": 0, "text": NAME, "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                         "total_tokens": 2}}))
    def log_message(self, *args):
        pass
ThreadingHTTPServer((os.environ["POD_IP"], 8000), Handler).serve_forever()
"""


def agent_pod(name: str, namespace: str, pool: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {
                "slipstream.dev/replica": "chat", "slipstream.dev/role": "controller",
                "slipstream.dev/instance": name, "slipstream.dev/pool": pool}},
            "spec": {"terminationGracePeriodSeconds": 2, "containers": [{
                "name": "agent", "image": "local/process",
                "command": ["python3", "-c", FAKE_AGENT],
                "ports": [{"name": "http", "containerPort": 8000}],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME",
                         "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000},
                                   "periodSeconds": 1},
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


@pytest.fixture
def namespace(dev_cluster) -> str:
    name = f"router-{uuid.uuid4().hex[:8]}"
    dev_cluster.create_namespace(name)
    yield name
    dev_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)



def pools_seen(base_url: str) -> dict[str, str]:
    try:
        view = httpx.get(f"{base_url}/router/instances", timeout=2).json()
    except (httpx.TransportError, json.JSONDecodeError):
        return {}
    return {entry["name"]: entry["pool"] for entry in view["instances"]}


def long_request_served_by(base_url: str) -> str:
    response = httpx.post(f"{base_url}/v1/completions", timeout=10,
                          json={"prompt": LONG_PROMPT, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["served_by"]


def test_relabelling_a_pod_moves_long_requests_within_one_watch_event(
        dev_cluster, namespace, tmp_path):
    dev_cluster.apply(agent_pod("agent-a", namespace, "short"))
    dev_cluster.apply(agent_pod("agent-b", namespace, "long"))
    with router_process(dev_cluster, namespace, "chat", tmp_path / "router.log",
                        "--long-prefill-threshold-tokens", str(THRESHOLD_TOKENS),
                        "--log-level", "info") as router:
        base_url = f"http://{router}"
        dev_cluster.wait_for(lambda: pools_seen(base_url) == {"agent-a": "short",
                                                              "agent-b": "long"},
                             90, "the router to see both Ready agent pods")
        pod_ips = {entry["url"] for entry in
                   httpx.get(f"{base_url}/router/instances", timeout=2).json()["instances"]}
        assert all(url.startswith("http://127.") for url in pod_ips), pod_ips  # loopback only
        assert long_request_served_by(base_url) == "agent-b"

        started = time.monotonic()
        dev_cluster.kubectl("label", "pod", "-n", namespace, "agent-b",
                            "slipstream.dev/pool=short", "--overwrite")
        dev_cluster.kubectl("label", "pod", "-n", namespace, "agent-a",
                            "slipstream.dev/pool=long", "--overwrite")
        dev_cluster.wait_for(lambda: pools_seen(base_url) == {"agent-a": "long",
                                                              "agent-b": "short"},
                             5, "the relabel to reach the router", period_s=0.05)
        elapsed_s = time.monotonic() - started
        print(f"relabel of two pods reached the router in {elapsed_s * 1000:.0f} ms")
        assert long_request_served_by(base_url) == "agent-a"
        # A watch event, not a resync: well under the watch's 30 s renewal.
        assert elapsed_s < 5, elapsed_s

        dev_cluster.kubectl("delete", "pod", "-n", namespace, "agent-a", "--wait=false")
        dev_cluster.wait_for(lambda: "agent-a" not in pools_seen(base_url), 30,
                             "a deleted pod to leave the pool")
        # The long pool is empty now: long prompts fall back to the short pool's instance.
        assert long_request_served_by(base_url) == "agent-b"
