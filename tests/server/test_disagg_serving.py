"""Prefill/decode disaggregation end to end: ``slipstream serve --role prefill`` and
``--role decode`` processes, KV moved between them by the Mooncake Transfer Engine (TCP),
chained by ``slipstream router``, driven with the official ``openai`` client. Greedy output
must equal a mixed instance's, the client must see one ordinary response, a decode instance
killed mid-stream must end the stream with an error event (not a hang), and every KV block
must come back on both sides."""

from __future__ import annotations

import random
import signal
import time

import openai
import pytest

from tests.engine.test_kv_transfer import MOONCAKE_WHEEL

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not MOONCAKE_WHEEL,
                                 reason="Mooncake publishes Linux x86-64 wheels only")]

BACKEND_HEADER = "x-slipstream-backend"
PREFILL_HEADER = "x-slipstream-prefill-backend"
KV_USED = "slipstream_kv_cache_blocks_used"
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
    request = dict(model="tiny-test", prompt="signal north", max_tokens=1, temperature=0)
    raw = router.client().completions.with_raw_response.create(**request)
    assert raw.headers[BACKEND_HEADER] == prefill.base_url
    assert raw.parse().choices[0].text == server.openai_client().completions.create(
        **request).choices[0].text
    chunks = list(router.client().completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == raw.parse().choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    _wait_for_baseline(prefill, decode)


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
