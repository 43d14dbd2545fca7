"""Limits that keep one client from hurting the others, against a real server and router:
bodies over the cap get 413 unread, half-sent requests get 408, a prompt too long for the
context is refused before it is tokenized, and a long prompt is tokenized off the event loop
while a short request beside it is answered."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny-test"
MAX_BODY_BYTES = 256 * 1024
READ_TIMEOUT_S = 2.0
LIMIT_FLAGS = ("--max-body-bytes", str(MAX_BODY_BYTES),
               "--request-read-timeout-s", str(READ_TIMEOUT_S))


@pytest.fixture(scope="module")
def limited(start_server):
    return start_server(*LIMIT_FLAGS)


@pytest.fixture(scope="module")
def limited_router(limited, run_router, tiny_model_dir, tmp_path_factory):
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router"),
                    [f"{limited.base_url}=short"], *LIMIT_FLAGS) as router:
        yield router


def _address(base_url: str) -> tuple[str, int]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def _assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error


@pytest.mark.parametrize("front", ["server", "router"])
def test_a_body_over_the_cap_gets_413(front, limited, limited_router):
    base_url = limited.base_url if front == "server" else limited_router.base_url
    body = b'{"model": "tiny-test", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    response = httpx.post(f"{base_url}/v1/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    _assert_openai_error(response, 413, "request_too_large")

    def chunks():  # no Content-Length: the cap holds while reading
        for _ in range(MAX_BODY_BYTES // 16384 + 2):
            yield b" " * 16384

    response = httpx.post(f"{base_url}/v1/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    _assert_openai_error(response, 413, "request_too_large")
    ok = httpx.post(f"{base_url}/v1/completions", timeout=60,
                    json={"model": MODEL, "prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("front", ["server", "router"])
def test_half_sent_headers_and_bodies_get_408(front, limited, limited_router):
    base_url = limited.base_url if front == "server" else limited_router.base_url
    bound_s = READ_TIMEOUT_S + 15.0  # loaded machine: the timer may fire late, never never
    with socket.create_connection(_address(base_url)) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        answer = _read_until_closed(sock, bound_s)
        assert time.monotonic() - started >= READ_TIMEOUT_S * 0.9
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer

    with socket.create_connection(_address(base_url)) as sock:  # sends nothing at all
        assert _read_until_closed(sock, bound_s).startswith(b"HTTP/1.1 408")

    with socket.create_connection(_address(base_url)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"prompt": ')
        answer = _read_until_closed(sock, bound_s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer.replace(b" ", b"")


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(limited):
    # ~200k characters: far past what 2048 tokens can hold, refused by the bound at once.
    prompt = "word " * 40_000
    response = httpx.post(f"{limited.base_url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    _assert_openai_error(response, 400, "context_length_exceeded")
    assert "more than" in response.json()["error"]["message"]


def test_a_long_prompt_does_not_stall_a_short_request(start_server):
    """A 1 MB prompt is tokenized on a worker thread (the GIL released): short requests sent
    meanwhile are answered before the long one is refused. The server's memory after several
    such requests, and after 3.6 MB ones, stays near where it started."""
    big = start_server("--max-model-len", "131072")
    process = psutil.Process(big.process.pid)
    # 1 MB of one-letter words: about 500k tokens. Under 8 characters a token of the context
    # (1M characters < 8 x 131,072), so it is tokenized whole (a longer text would be
    # counted in pieces and refused sooner), then refused for the context. That takes about
    # 0.9 s on an idle machine and several seconds on a loaded one.
    prompt = "a b " * 250_000
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    short = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=big.base_url, timeout=300) as client:
        assert client.post("/v1/completions", json=short).status_code == 200
        rss_before = process.memory_info().rss
        done: dict[str, float] = {}
        answers: dict[str, httpx.Response] = {}

        def send_long() -> None:
            answers["long"] = httpx.post(f"{big.base_url}/v1/completions", json=body,
                                         timeout=300)
            done["long"] = time.monotonic()

        worker = threading.Thread(target=send_long)
        started = time.monotonic()
        worker.start()
        # Short requests, one after another, for as long as the long one is in the server.
        # Count those sent after it has surely arrived (its 1 MB body takes milliseconds on
        # loopback; allow 0.25 s) and answered before it was: with the event loop stalled by
        # tokenizing there would be none.
        latencies = []
        while worker.is_alive():
            sent = time.monotonic()
            assert client.post("/v1/completions", json=short).status_code == 200
            if worker.is_alive() and sent - started > 0.25:
                latencies.append(time.monotonic() - sent)
        worker.join()
        _assert_openai_error(answers["long"], 400, "context_length_exceeded")
        long_s = done["long"] - started
        latencies.sort()
        print(f"\nthe long prompt took {long_s:.1f} s to refuse; meanwhile {len(latencies)} "
              f"short requests were answered"
              + (f", median {latencies[len(latencies) // 2]:.3f} s, max {latencies[-1]:.3f} s"
                 if latencies else ""))
        assert len(latencies) >= 3, "short requests waited for the long prompt"
        huge = {**body, "prompt": "hello world " * 300_000}  # 3.6 MB: counted, cut short
        for request in (body, huge, huge, huge):
            assert client.post("/v1/completions", json=request).status_code == 400
        rss_after = process.memory_info().rss
    growth_mib = (rss_after - rss_before) / 2**20
    print(f"server RSS before {rss_before / 2**20:.0f} MiB, after 2 refused 1 MB and 3 refused "
          f"3.6 MB prompts {rss_after / 2**20:.0f} MiB ({growth_mib:+.0f} MiB)")
    assert growth_mib < 256
