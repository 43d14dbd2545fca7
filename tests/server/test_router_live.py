"""``slipstream router`` in front of real ``slipstream serve`` processes, over real HTTP with
the official ``openai`` client: routing by prompt length, SSE passthrough, retry on another
instance when one fails before the first token, and the router's own metrics."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.contracts import metric_names

THRESHOLD_TOKENS = 48
BACKEND_HEADER = "x-slipstream-backend"
SHORT_PROMPT = "hello world"
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 12


@pytest.fixture(scope="module")
def short_backend(start_server):
    return start_server(pool="short")


@pytest.fixture(scope="module")
def long_backend(start_server):
    return start_server(pool="long")


@pytest.fixture(scope="module")
def router(run_router, tiny_model_dir, tmp_path_factory, short_backend, long_backend):
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router"),
                    [f"{short_backend.base_url}=short", f"{long_backend.base_url}=long"]) as r:
        yield r


def _served_by(router, prompt: str, **kwargs) -> tuple[str, str]:
    raw = router.client().completions.with_raw_response.create(
        model="tiny-test", prompt=prompt, max_tokens=4, temperature=0, **kwargs)
    return raw.headers[BACKEND_HEADER], raw.parse().choices[0].text


def test_prompts_are_routed_to_their_pool_by_token_count(router, short_backend, long_backend):
    assert _served_by(router, SHORT_PROMPT)[0] == short_backend.base_url
    assert _served_by(router, LONG_PROMPT)[0] == long_backend.base_url
    assert router.metric("slipstream_router_requests_total", request_class="long",
                         pool="long", outcome="ok") == 1


def test_chat_is_classified_with_the_chat_template(router, short_backend, long_backend):
    client = router.client()
    for content, expected in ((SHORT_PROMPT, short_backend), (LONG_PROMPT, long_backend)):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-test", messages=[{"role": "user", "content": content}], max_tokens=3)
        assert raw.headers[BACKEND_HEADER] == expected.base_url
        assert raw.parse().choices[0].message.content is not None


def test_streams_pass_through_unchanged(router, short_backend):
    request = dict(model="tiny-test", messages=[{"role": "user", "content": SHORT_PROMPT}],
                   max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
                   stream_options={"include_usage": True})
    via_router = list(router.client().chat.completions.create(**request))
    direct = list(short_backend.openai_client().chat.completions.create(**request))

    def text(chunks) -> str:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert text(via_router) == text(direct)
    assert via_router[0].choices[0].delta.role == "assistant"
    assert via_router[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in via_router if c.choices][-1] == "length"


def test_client_errors_come_back_unchanged_and_are_not_retried(router):
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        router.client().completions.create(model="tiny-test", prompt=SHORT_PROMPT,
                                           max_tokens=2, presence_penalty=5.0)
    assert router.metric("slipstream_router_retries_total") == 0


def test_router_metrics_are_exactly_the_registry(router):
    _served_by(router, SHORT_PROMPT)
    text = httpx.get(f"{router.base_url}/metrics", timeout=10).text
    exported = {family.name: family for family in text_string_to_metric_families(text)}
    assert set(exported) == {spec.constructor_name for spec in metric_names.ROUTER_METRICS}
    for spec in metric_names.ROUTER_METRICS:
        for sample in exported[spec.constructor_name].samples:
            assert set(sample.labels) - {"le"} == set(spec.labels), (spec.name, sample.labels)
    assert router.metric("slipstream_router_pool_instances", pool="short") == 1
    promtool = shutil.which("promtool")
    if promtool is not None:
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and not result.stdout.strip(), result.stdout


def test_a_killed_instance_is_retried_on_another_before_the_first_token(
        run_router, tiny_model_dir, tmp_path_factory, start_server, short_backend):
    doomed = start_server(pool="short")
    # Stats are polled rarely here, so only failed requests can tell the router.
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-retry"),
                    [f"{doomed.base_url}=short", f"{short_backend.base_url}=short"],
                    "--stats-interval-seconds", "600") as router:
        # The router is ready once either instance serves; kill the doomed one only after
        # the first poll has seen both serving, or the poll itself finds it dead and no
        # request ever needs the retry.
        deadline = time.monotonic() + 60
        while httpx.get(f"{router.base_url}/health", timeout=5).json()["instances"] < 2:
            assert time.monotonic() < deadline, "the router's first poll never saw both"
            time.sleep(0.1)
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=10)
        client = router.client()
        for index in range(4):
            stream = index % 2 == 0
            raw = client.completions.with_raw_response.create(
                model="tiny-test", prompt=f"{SHORT_PROMPT} {index}", max_tokens=3,
                stream=stream)
            assert raw.headers[BACKEND_HEADER] == short_backend.base_url
            if stream:
                assert "".join(chunk.choices[0].text for chunk in raw.parse()
                               if chunk.choices) is not None
        assert router.metric("slipstream_router_retries_total", pool="short") >= 1
        assert router.wait_for_metric("slipstream_router_requests_total", 4, outcome="ok") == 4
        # Streams read to [DONE] are served whole, even when the client leaves right there.
        assert router.metric("slipstream_router_requests_total", outcome="cancelled") == 0


class DropAfterRoleChunk:
    """A peer that accepts a streaming request, sends the status line and the role-only chunk
    (no token yet), then drops the connection: an instance dying mid-prefill."""

    ROLE_CHUNK = (b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m",'
                  b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with connection:
                self.connections += 1
                connection.recv(65536)
                connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                   b"transfer-encoding: chunked\r\n\r\n"
                                   + f"{len(self.ROLE_CHUNK):x}\r\n".encode()
                                   + self.ROLE_CHUNK + b"\r\n")


def test_a_request_whose_instance_fails_under_it_is_not_resent_elsewhere(
        run_router, tiny_model_dir, tmp_path_factory, short_backend):
    """The instance dropped the connection while holding the request: the request may be
    what broke it, so it gets a clean 502 and never meets a second instance."""
    dropper = DropAfterRoleChunk()
    # The dropper fails every request, its /metrics too: with no cooldown it stays a
    # candidate, so requests keep meeting it (ties rotate).
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-drop"),
                    [f"{dropper.url}=short", f"{short_backend.base_url}=short"],
                    "--stats-interval-seconds", "600", "--unhealthy-cooldown-seconds", "0"
                    ) as router:
        dropper.connections = 0
        served = {"dropped": 0, "ok": 0}
        for index in range(6):
            response = httpx.post(f"{router.base_url}/v1/chat/completions", timeout=60, json={
                "model": "tiny-test", "messages": [{"role": "user", "content": f"hi {index}"}],
                "max_tokens": 4, "stream": True, "ignore_eos": True})
            if response.status_code == 200:
                served["ok"] += 1
                assert response.text.rstrip().endswith("data: [DONE]")
                continue
            served["dropped"] += 1
            assert response.status_code == 502
            error = response.json()["error"]
            assert error["code"] == "instance_failed" and "not retried" in error["message"]
        assert served["dropped"] == dropper.connections >= 1
        assert router.metric("slipstream_router_retries_total") == 0
    dropper.server.close()


def test_under_saturation_a_light_application_overtakes_a_flood(run_router, tiny_model_dir, tmp_path_factory,
                                                                short_backend):
    """One request at a time per instance. App "flood" queues eight requests, then app
    "light" sends two of the same size: first come, first served would finish light last;
    the router's fair queue (Justitia's virtual finish times) lets light in between."""
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-fair"),
                    [f"{short_backend.base_url}=short"],
                    "--max-in-flight-per-instance", "1") as router:
        client = router.client()
        finished: list[str] = []
        lock = threading.Lock()

        def send(app_id: str, index: int) -> None:
            client.completions.create(model="tiny-test", prompt=f"{SHORT_PROMPT} {index}",
                                      max_tokens=24, temperature=0,
                                      extra_body={"app_id": app_id, "ignore_eos": True})
            with lock:
                finished.append(app_id)

        flood = [threading.Thread(target=send, args=("flood", i)) for i in range(8)]
        for thread in flood:
            thread.start()
        deadline = time.monotonic() + 30
        while router.metric("slipstream_router_queue_depth", request_class="short") < 5:
            assert time.monotonic() < deadline, "the flood never queued at the router"
            time.sleep(0.01)
        light = [threading.Thread(target=send, args=("light", 100 + i)) for i in range(2)]
        for thread in light:
            thread.start()
        for thread in flood + light:
            thread.join(timeout=120)
    assert sorted(finished) == ["flood"] * 8 + ["light"] * 2
    last_light = max(i for i, app in enumerate(finished) if app == "light")
    flood_after_light = sum(1 for app in finished[last_light:] if app == "flood")
    assert flood_after_light >= 3, finished
