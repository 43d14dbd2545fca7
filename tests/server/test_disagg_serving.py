"""Prefill/decode disaggregation end to end: ``slipstream serve --role prefill`` and
``--role decode`` processes, KV moved between them by the Mooncake Transfer Engine (TCP),
chained by ``slipstream router``, driven with the official ``openai`` client. Greedy output
must equal a mixed instance's, the client must see one ordinary response, a decode instance
killed mid-stream must end the stream with an error event (not a hang), and every KV block
must come back on both sides.

The router's prefill leg is streamed: its first event is the streaming KV handle and the
decode leg starts on it, so the decode instance reads prompt blocks while the prefill
instance still computes later chunks. ``prefill`` runs the engine in the default layout,
``chunked_prefill`` in the other one, so the early handle is tested across the engine-core
wire and on the engine thread."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import openai
import pytest

from tests.engine.test_kv_transfer import MOONCAKE_WHEEL
from tests.server.conftest import DEFAULT_LAYOUT

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not MOONCAKE_WHEEL,
                                 reason="Mooncake publishes Linux x86-64 wheels only")]

BACKEND_HEADER = "x-slipstream-backend"
PREFILL_HEADER = "x-slipstream-prefill-backend"
KV_USED = "slipstream_kv_cache_blocks_used"
KV_TRANSFERS = "slipstream_kv_transfers_total"
OVERLAPPED = "slipstream_kv_transfer_overlapped_blocks_total"
REQUESTS = "slipstream_requests_total"
OTHER_LAYOUT = "--single-process" if DEFAULT_LAYOUT == "process" else "--engine-process"
# 8-token prefill chunks: a long prompt takes a couple of hundred engine steps, time for the
# decode instance to read blocks while later chunks are computed even on a loaded machine.
CHUNK_TOKENS = 8
LONG_PROMPT_TOKENS = 1800
WORDS = ("alpha beta gamma delta river stone cloud night paper light green seven orbit "
         "quiet signal north table amber").split()


@pytest.fixture(scope="module")
def prefill(start_server):
    return start_server("--role", "prefill", "--kv-transport", "mooncake",
                        "--kv-blocks-per-read", "2", pool="short")


@pytest.fixture(scope="module")
def decode(start_server):
    return start_server("--role", "decode", "--kv-transport", "mooncake",
                        "--kv-blocks-per-read", "2", pool="decode")


@pytest.fixture(scope="module")
def router(run_router, tiny_model_dir, tmp_path_factory, prefill, decode):
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-pd"),
                    [f"{prefill.base_url}=short", f"{decode.base_url}=decode"]) as r:
        yield r


@pytest.fixture(scope="module")
def chunked_prefill(start_server):
    """A prefill instance in the non-default engine layout with small prefill chunks."""
    return start_server("--role", "prefill", "--kv-transport", "mooncake", OTHER_LAYOUT,
                        "--max-batched-tokens", str(CHUNK_TOKENS), pool="short")


@pytest.fixture(scope="module")
def chunked_router(run_router, tiny_model_dir, tmp_path_factory, chunked_prefill, decode):
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-pd-chunked"),
                    [f"{chunked_prefill.base_url}=short", f"{decode.base_url}=decode"]) as r:
        yield r


def _long_prompt(seed: int) -> list[int]:
    """Token ids (byte tokens, never special ones), so the length is exact."""
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(LONG_PROMPT_TOKENS)]


def _wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _prompts(count: int) -> list[str]:
    rng = random.Random(19)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 90)))
            for _ in range(count)]


def _wait_for_baseline(*servers, timeout_s: float = 30.0) -> None:
    for server in servers:
        assert server.wait_for_metric(KV_USED, 0.0, timeout_s=timeout_s) == 0.0, server.base_url


def test_greedy_output_equals_a_mixed_instance_for_many_prompts(router, server, prefill,
                                                                decode):
    via_router, direct = router.client(), server.openai_client()
    for index, prompt in enumerate(_prompts(16)):
        request = dict(model="tiny-test", prompt=prompt, max_tokens=10 + index % 5,
                       temperature=0, extra_body={"ignore_eos": True})
        raw = via_router.completions.with_raw_response.create(**request)
        got, expected = raw.parse(), direct.completions.create(**request)
        assert raw.headers[BACKEND_HEADER] == decode.base_url
        assert raw.headers[PREFILL_HEADER] == prefill.base_url
        assert got.choices[0].text == expected.choices[0].text, prompt
        assert got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == expected.usage.completion_tokens
        assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    _wait_for_baseline(prefill, decode)


def test_one_stream_reaches_the_client_for_chat_and_completions(router, server):
    def text(chunks) -> str:
        return "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta")
                       else c.choices[0].text for c in chunks if c.choices)

    chat = dict(model="tiny-test", messages=[{"role": "user", "content": "tell me a story"}],
                max_tokens=14, temperature=0, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True})
    chunks = list(router.client().chat.completions.create(**chat))
    reference = list(server.openai_client().chat.completions.create(**chat))
    assert text(chunks) == text(reference) and text(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 14
    completion = dict(model="tiny-test", prompt="paper orbit quiet", max_tokens=9,
                      temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert text(router.client().completions.create(**completion)) == \
        text(server.openai_client().completions.create(**completion))


def test_a_request_that_ends_at_its_first_token_never_needs_a_decode(router, server, prefill,
                                                                     decode):
    """The decode leg started on the early handle is cancelled once the prefill stream ends
    without a hand-off; the client gets the prefill instance's answer, and both sides free
    everything (the decode instance acknowledges, the prefill instance drops its hold)."""
    request = dict(model="tiny-test", prompt="signal north", max_tokens=1, temperature=0)
    raw = router.client().completions.with_raw_response.create(**request)
    assert raw.headers[BACKEND_HEADER] == prefill.base_url
    assert raw.parse().choices[0].text == server.openai_client().completions.create(
        **request).choices[0].text
    chunks = list(router.client().completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == raw.parse().choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = dict(model="tiny-test", messages=[{"role": "user", "content": "signal north"}],
                max_tokens=1, temperature=0)
    via_router = router.client().chat.completions.create(**chat)
    mixed = server.openai_client().chat.completions.create(**chat)
    assert via_router.choices[0].message.content == mixed.choices[0].message.content
    assert via_router.choices[0].finish_reason == mixed.choices[0].finish_reason == "length"
    # A stop string that matches the first token: found by the API process when the engine
    # runs in its own process, after the engine already handed the KV off.
    first_text = raw.parse().choices[0].text
    if first_text.strip():
        stopped = dict(model="tiny-test", prompt="signal north", max_tokens=8, temperature=0,
                       stop=[first_text.strip()])
        got = router.client().completions.create(**stopped)
        expected = server.openai_client().completions.create(**stopped)
        assert (got.choices[0].text, got.choices[0].finish_reason) == \
            (expected.choices[0].text, expected.choices[0].finish_reason)
        assert got.choices[0].finish_reason == "stop"
    _wait_for_baseline(prefill, decode)


def test_a_streamed_prefill_leg_sends_its_kv_handle_before_any_token(prefill, decode, server):
    """The agents' side of the router's chain, driven by hand with raw SSE: the prefill
    instance's first event is the streaming handle; a decode instance given it at once
    answers like a mixed instance; the prefill stream ends with the complete handle of the
    same hold."""
    prompt = _long_prompt(seed=7)[:300]
    body = {"model": "tiny-test", "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", f"{prefill.base_url}/v1/completions",
            json={**body, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}
    ) as leg:
        assert leg.status_code == 200
        events = (json.loads(line[5:]) for line in leg.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]")
        first = next(events)
        handle = first["kv_transfer_params"]
        assert first["object"] == "slipstream.kv_transfer" and "choices" not in first
        assert handle["streaming"] and handle["block_ids"] == [] and handle["first_token_id"] == -1
        decoded = http.post(f"{decode.base_url}/v1/completions",
                            json={**body, "kv_transfer_params": {**handle,
                                                                 "do_remote_prefill": True}})
        rest = list(events)
    assert decoded.status_code == 200, decoded.text
    mixed = server.openai_client().completions.create(
        model="tiny-test", prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    assert decoded.json()["choices"][0]["text"] == mixed.choices[0].text
    tokens = [e for e in rest if e.get("choices")]
    assert tokens and tokens[-1]["choices"][0]["finish_reason"] == "length"
    (complete,) = [e["kv_transfer_params"] for e in rest if "kv_transfer_params" in e]
    assert complete["transfer_id"] == handle["transfer_id"] and not complete["streaming"]
    assert "kv_transfer_params" not in rest[0]  # the complete handle comes after the tokens
    _wait_for_baseline(prefill, decode)


def test_through_the_router_the_decode_instance_reads_blocks_during_the_prefill(
        chunked_router, server, chunked_prefill, decode):
    """The decode leg starts on the prefill leg's first event, so the decode instance reads
    prompt blocks while later chunks are still computed (its overlapped-blocks counter
    grows; the old chain, which started the decode leg after the prompt, never moved it).
    Output equals a mixed instance's. A loaded machine may, rarely, finish one prefill
    before the decode leg arrives: up to three prompts are tried for the overlap."""
    overlapped = 0
    for seed in range(3):
        before = decode.metric(OVERLAPPED)
        completed = decode.metric(KV_TRANSFERS, outcome="completed")
        request = dict(model="tiny-test", prompt=_long_prompt(seed), max_tokens=12,
                       temperature=0, extra_body={"ignore_eos": True})
        raw = chunked_router.client().completions.with_raw_response.create(**request)
        got, expected = raw.parse(), server.openai_client().completions.create(**request)
        assert raw.headers[BACKEND_HEADER] == decode.base_url
        assert raw.headers[PREFILL_HEADER] == chunked_prefill.base_url
        assert got.choices[0].text == expected.choices[0].text
        assert got.usage.prompt_tokens == expected.usage.prompt_tokens == LONG_PROMPT_TOKENS
        assert got.usage.completion_tokens == 12
        _wait_until(lambda: decode.metric(KV_TRANSFERS, outcome="completed") > completed,
                    "the decode instance to count the transfer")
        overlapped = decode.metric(OVERLAPPED) - before
        if overlapped > 0:
            break
    assert 0 < overlapped < LONG_PROMPT_TOKENS // 16 + 1
    # A chat stream takes the same overlapped path and reads as one stream.
    chat = dict(model="tiny-test", messages=[{"role": "user", "content": "amber river " * 200}],
                max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or ""
                   for c in chunked_router.client().chat.completions.create(**chat) if c.choices)
    assert text == "".join(c.choices[0].delta.content or "" for c in
                           server.openai_client().chat.completions.create(**chat) if c.choices)
    _wait_for_baseline(chunked_prefill, decode)


def test_a_client_leaving_mid_prompt_frees_both_legs(chunked_router, chunked_prefill, decode):
    """The client gives up while the prompt is computed and the decode instance is already
    reading it: the router closes both legs at once; the prefill instance aborts the request
    (no hand-off), the decode instance never completes its transfer, and both sides are
    back to zero used blocks."""
    aborted = chunked_prefill.metric(REQUESTS, finish_reason="abort")
    completed = decode.metric(KV_TRANSFERS, outcome="completed")

    def mid_prompt() -> bool:
        return decode.metric(KV_USED) > 0 and chunked_prefill.metric(KV_USED) > 0

    async def leave_mid_prompt() -> None:
        client = openai.AsyncOpenAI(base_url=f"{chunked_router.base_url}/v1",
                                    api_key="unused", max_retries=0, timeout=120)
        request = asyncio.ensure_future(client.completions.create(
            model="tiny-test", prompt=_long_prompt(seed=11), max_tokens=200, temperature=0,
            stream=True, extra_body={"ignore_eos": True}))
        try:
            deadline = time.monotonic() + 60
            while not await asyncio.to_thread(mid_prompt):
                assert not request.done(), "the request finished before it was seen mid-prompt"
                assert time.monotonic() < deadline, "the legs never held blocks together"
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
        finally:
            await client.close()

    asyncio.run(leave_mid_prompt())
    _wait_for_baseline(chunked_prefill, decode)
    assert chunked_prefill.metric(REQUESTS, finish_reason="abort") == aborted + 1
    assert decode.metric(KV_TRANSFERS, outcome="completed") == completed


def test_bad_input_is_a_400_from_the_prefill_instance(router, prefill, decode):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        router.client().completions.create(model="tiny-test", prompt="hi", max_tokens=0)
    _wait_for_baseline(prefill, decode)


def test_a_decode_instance_killed_mid_stream_ends_the_stream_with_an_error(
        run_router, tiny_model_dir, tmp_path_factory, serve_process, prefill):
    log_dir = tmp_path_factory.mktemp("doomed-decode")
    with serve_process(log_dir, "--role", "decode", "--kv-transport", "mooncake",
                       pool="decode") as doomed, \
            run_router(tiny_model_dir, tmp_path_factory.mktemp("router-doomed"),
                       [f"{prefill.base_url}=short", f"{doomed.base_url}=decode"]) as router:
        stream = router.client().completions.create(
            model="tiny-test", prompt="amber river " * 20, max_tokens=1500, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        received = 0
        started = time.monotonic()
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for chunk in stream:
                received += 1
                if received == 3:
                    doomed.process.send_signal(signal.SIGKILL)
        assert received >= 3 and time.monotonic() - started < 60
    # The decode instance had fetched and acknowledged the KV before it streamed: the prefill
    # side is back at its baseline.
    _wait_for_baseline(prefill)
