"""A worker dies mid-request: the real HTTP server answers the in-flight requests with a
500 ``engine_dead`` (they were running when the engine broke, so no router resends them: one
of them may be what broke it), refuses new ones with 503 ``engine_unavailable`` (they never
ran, so another instance may serve them), exits non-zero within a bounded time, and leaves no
worker process behind."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.bench import local_process
from slipstream.agent.parallel.launch import free_port

START_TIMEOUT_S = 180.0
EXIT_BOUND_S = 20.0  # from the kill to the server's exit (detection is sub-second)
EXIT_ENGINE_DEAD = 3


@pytest.fixture
def parallel_server(tiny_model_dir, tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    base_url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "slipstream.cli", "serve", "--model", str(tiny_model_dir),
            "--device", "cpu", "--spp", "2", "--port", str(port), "--max-model-len", "4096",
            "--num-kv-blocks", "512", "--log-level", "warning", "--no-profile"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")}
    with local_process.running(argv, log_path, f"{base_url}/health", env=env,
                               timeout_s=START_TIMEOUT_S) as process:
        yield base_url, process, log_path


def test_killed_worker_fails_requests_in_flight_and_exits_nonzero(parallel_server):
    base_url, process, log_path = parallel_server
    server = psutil.Process(process.pid)
    # With the engine in its own process (the default) the workers are that process's children.
    cores = [child for child in server.children() if "spawn_main" in " ".join(child.cmdline())]
    workers = [child for child in (cores[0] if cores else server).children()
               if "resource_tracker" not in " ".join(child.cmdline())]  # Python's own helper
    assert len(workers) == 2, "spp=2 should run two worker processes"
    body = {"prompt": "a long answer please", "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True}
    answers: list[httpx.Response] = []
    blocking = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)))
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{base_url}/v1/completions", json={**body, "stream": True}) as stream:
        blocking.start()
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        # Kill only once the engine runs both: a request that arrives after the kill is a new
        # request, which gets the 503 of an unhealthy instance instead (checked below).
        wait_until_running(client, base_url, 2)
        os.kill(workers[-1].pid, signal.SIGKILL)
        killed_s = time.monotonic()
        rest = "\n".join(lines)
    blocking.join(timeout=EXIT_BOUND_S)
    assert answers, "the non-streaming request did not come back"
    assert answers[0].status_code == 500, answers[0].text
    assert answers[0].json()["error"]["code"] == "engine_dead"
    late = _post_if_still_listening(f"{base_url}/v1/completions", body)
    if late is not None:  # the server had not exited yet: a new request is a clean 503
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "engine_unavailable"
    assert '"engine_dead"' in rest  # the stream ends with an error event
    assert rest.rstrip().endswith("data: [DONE]")
    code = process.wait(timeout=EXIT_BOUND_S)
    assert time.monotonic() - killed_s < EXIT_BOUND_S
    assert code == EXIT_ENGINE_DEAD, log_path.read_text()
    assert "worker" in log_path.read_text()
    time.sleep(0.5)
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


def running_requests(client: httpx.Client, base_url: str) -> float:
    text = client.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "slipstream_queue_depth" and sample.labels.get("state") == "running":
                return sample.value
    return 0.0


def wait_until_running(client: httpx.Client, base_url: str, count: int,
                       timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while running_requests(client, base_url) < count:
        assert time.monotonic() < deadline, f"the engine never ran {count} requests at once"
        time.sleep(0.05)


def _post_if_still_listening(url: str, body: dict) -> httpx.Response | None:
    try:
        return httpx.post(url, json=body, timeout=10)
    except httpx.TransportError:
        return None  # already gone, as it should be soon
