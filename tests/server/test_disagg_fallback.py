"""A prefill/decode router whose decode instances are all down: requests are served whole by
the prefill instance, not refused, and no KV stays held on it (issue 30). Real processes:
``slipstream serve --role prefill`` (ZeroMQ transport, nothing else to install) and
``slipstream router`` with a decode backend on a port where nothing listens."""

from __future__ import annotations

import httpx
import pytest

from slipstream.agent.parallel.launch import free_port

pytestmark = pytest.mark.timeout(300)

KV_USED = "slipstream_kv_cache_blocks_used"
BACKEND_HEADER = "x-slipstream-backend"
SERVED_WHOLE_HEADER = "x-slipstream-served-whole"


@pytest.fixture(scope="module")
def prefill(start_server):
    # A hold timeout far beyond the test: blocks that come back came back by release.
    return start_server("--role", "prefill", "--kv-transport", "zmq",
                        "--kv-hold-timeout-seconds", "3600", pool="short")


@pytest.fixture(scope="module")
def router(run_router, tiny_model_dir, tmp_path_factory, prefill):
    down = f"http://127.0.0.1:{free_port()}"  # a decode instance that is not up
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-no-decode"),
                    [f"{prefill.base_url}=short", f"{down}=decode"]) as r:
        yield r


def test_requests_are_served_whole_when_no_decode_instance_is_up(router, prefill):
    client = router.client()
    for index in range(4):
        raw = client.completions.with_raw_response.create(
            model="tiny-test", prompt=f"hello number {index}", max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True})
        answer = raw.parse()
        assert raw.headers[BACKEND_HEADER] == prefill.base_url
        assert raw.headers[SERVED_WHOLE_HEADER] == "no-decode-instance"
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="tiny-test", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, extra_body={"ignore_eos": True})
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1
    # Nothing is left held for a decode instance that will never come.
    assert prefill.wait_for_metric(KV_USED, 0.0, timeout_s=30) == 0.0


def test_the_release_endpoint_checks_the_transfer_id(prefill):
    url = f"{prefill.base_url}/v1/kv_transfer/release"
    for bad in ({}, {"transfer_id": 7}, {"transfer_id": "not hex!"}, {"transfer_id": "a" * 65}):
        answer = httpx.post(url, json=bad, timeout=10)
        assert answer.status_code == 400, bad
        assert answer.json()["error"]["param"] == "transfer_id"
    unknown = httpx.post(url, json={"transfer_id": "ab" * 16}, timeout=10)
    assert unknown.status_code == 200 and unknown.json()["released"] is True
