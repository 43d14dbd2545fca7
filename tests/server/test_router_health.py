"""The router's ``/health`` with dead backends, over real HTTP: a real ``slipstream router``
process in front of small stand-in agents (stdlib HTTP servers in this process), one of which
never existed and others that die while the router runs.

It is 200 while at least one backend serves and 503 when none does; ``instances`` counts only
serving backends, and ``backends`` says per backend what the router saw. A dead backend stays
out: not merely for the cooldown after a failed poll, but until a poll finds it serving.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from slipstream.agent.parallel.launch import free_port

POLL_S = 0.5
# Shorter than the poll period: before, a refused backend counted again between the end of
# its cooldown and the next poll.
COOLDOWN_S = 0.05


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = b"" if self.path == "/metrics" else json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain" if self.path == "/metrics"
                         else "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class StandIn:
    """An agent that answers /health and /metrics until ``kill()``."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kill(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def health(router) -> tuple[int, dict]:
    response = httpx.get(f"{router.base_url}/health", timeout=10)
    return response.status_code, response.json()


def wait_health(router, check, what: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        code, body = health(router)
        if check(code, body):
            return body
        assert time.monotonic() < deadline, f"{what}: last /health {code} {body}"
        time.sleep(0.05)


def by_url(body: dict) -> dict[str, dict]:
    return {backend["url"]: backend for backend in body["backends"]}


def test_health_counts_only_serving_backends_and_says_why_the_others_are_out(
        run_router, tiny_model_dir, tmp_path):
    a, b = StandIn(), StandIn()
    never = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        with run_router(tiny_model_dir, tmp_path, [f"{a.url}=short", f"{b.url}=short",
                                             f"{never}=short"],
                        "--stats-interval-seconds", str(POLL_S),
                        "--unhealthy-cooldown-seconds", str(COOLDOWN_S)) as router:
            body = wait_health(router, lambda code, body: code == 200
                               and body["instances"] == 2 and by_url(body)[never]["state"]
                               == "not_serving", "the unreachable backend out")
            assert body["status"] == "ok" and body["known_instances"] == 3
            dead = by_url(body)[never]
            assert "ConnectError" in dead["reason"], dead
            assert {by_url(body)[u]["state"] for u in (a.url, b.url)} == {"serving"}

            # Over several poll periods (each far longer than the cooldown), the unreachable
            # backend is never counted again.
            seen = []
            deadline = time.monotonic() + 4 * POLL_S
            while time.monotonic() < deadline:
                code, body = health(router)
                seen.append((code, body["instances"], by_url(body)[never]["state"]))
            assert set(seen) == {(200, 2, "not_serving")}, sorted(set(seen))

            # A backend that dies while the router runs leaves the count at its next poll.
            b.kill()
            body = wait_health(router, lambda code, body: body["instances"] == 1,
                               "the killed backend out")
            assert by_url(body)[b.url]["state"] == "not_serving"
            assert by_url(body)[a.url]["state"] == "serving"

            # The last one: the router is no longer ready, and still says what it knows.
            a.kill()
            body = wait_health(router, lambda code, body: code == 503, "no backend serving")
            assert body["status"] == "no instances" and body["instances"] == 0
            assert body["known_instances"] == 3
            assert {backend["state"] for backend in body["backends"]} == {"not_serving"}
    finally:
        for stand_in in (a, b):
            stand_in.server.server_close()
