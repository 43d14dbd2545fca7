"""The OpenAI-compatible endpoints through real HTTP with the official ``openai`` client."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(300)


def test_models_and_health(server):
    client = server.openai_client()
    models = client.models.list().data
    assert [model.id for model in models] == [server.model]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_completion_returns_text_and_usage(server):
    client = server.openai_client()
    prompt = "The quick brown fox"
    result = client.completions.create(model=server.model, prompt=prompt, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    assert result.usage.completion_tokens == 12
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12


def test_greedy_completion_is_repeatable(server):
    client = server.openai_client()
    first = client.completions.create(model=server.model, prompt="Once upon a time",
                                      max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model=server.model, prompt="Once upon a time",
                                       max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert first.choices[0].text == second.choices[0].text


def test_chat_completion_with_max_completion_tokens(server):
    client = server.openai_client()
    result = client.chat.completions.create(
        model=server.model, max_completion_tokens=7, temperature=0,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Say hello."}],
        extra_body={"ignore_eos": True, "app_id": "tests", "priority": 1,
                    "slo": {"ttft_s": 30, "tpot_ms": 5000}})
    choice = result.choices[0]
    assert result.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 7
    # The chat template wraps the two messages in role headers: more tokens than the words.
    assert result.usage.prompt_tokens > 8


def test_chat_logprobs(server):
    client = server.openai_client()
    result = client.chat.completions.create(
        model=server.model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": "Count to three."}],
        extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for token in content:
        assert token.logprob <= 0.0
        assert len(token.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert token.logprob == pytest.approx(max(t.logprob for t in token.top_logprobs))


def test_completion_logprobs(server):
    client = server.openai_client()
    result = client.completions.create(model=server.model, prompt="Hello", max_tokens=5,
                                       temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def _requests_in_flight(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "slipstream_requests_in_flight")


def test_chat_stream_is_incremental(server):
    """Tokens are delivered as produced: the first text reaches the client while the server
    still counts the request in flight (a server that answered only once the generation had
    ended would have counted it finished by then). No timing is compared, so a loaded
    machine cannot fail it; the only race is the client stalling for the whole generation
    of 1500 tokens between reading one chunk and asking for /metrics."""
    client = server.openai_client()
    messages = [{"role": "user", "content": "Tell me a story."}]
    stream = client.chat.completions.create(
        model=server.model, max_tokens=1500, temperature=0, stream=True,
        stream_options={"include_usage": True}, messages=messages,
        extra_body={"ignore_eos": True})
    pieces, finish_reasons, usage, in_flight_at_first_text = [], [], None, None
    num_chunks = 0
    for chunk in stream:
        num_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
        if in_flight_at_first_text is None and "".join(pieces):
            in_flight_at_first_text = _requests_in_flight(server)
    assert in_flight_at_first_text == 1.0
    assert _requests_in_flight(server) == 0.0
    assert num_chunks >= 10
    assert finish_reasons == ["length"]
    assert usage is not None and usage.completion_tokens == 1500
    # Streaming and non-streaming produce the same greedy text.
    whole = client.chat.completions.create(
        model=server.model, max_tokens=1500, temperature=0, messages=messages,
        extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].message.content


def test_completion_stream_usage_and_finish(server):
    client = server.openai_client()
    stream = client.completions.create(model=server.model, prompt="Streaming test", stream=True,
                                       max_tokens=20, temperature=0,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 5
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 20


def test_stop_string_ends_generation(server):
    client = server.openai_client()
    free = client.completions.create(model=server.model, prompt="abc", max_tokens=30,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    if len(text) < 4:
        pytest.skip("the tiny model produced too little text to pick a stop string from")
    stop = text[2:4]
    stopped = client.completions.create(model=server.model, prompt="abc", max_tokens=30,
                                        temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)


def test_default_max_tokens_fills_the_context(server):
    # Without max_tokens the request may use the rest of the context window.
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "model": server.model, "prompt": list(range(5, 5 + 2000)), "ignore_eos": True,
        "temperature": 0})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == 2000
    assert usage["completion_tokens"] == 2048 - 2000


def test_metrics_record_requests(server):
    client = server.openai_client()
    labels = {"request_class": "short", "pool": "short"}
    ttft_before = server.metric("slipstream_time_to_first_token_seconds_count", **labels)
    tokens_before = server.metric("slipstream_generation_tokens_total")
    result = client.completions.create(model=server.model, prompt="metrics", max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 6
    assert server.metric("slipstream_time_to_first_token_seconds_count", **labels) \
        == ttft_before + 1
    assert server.metric("slipstream_generation_tokens_total") == tokens_before + 6
    assert server.metric("slipstream_kv_cache_blocks_capacity") == 512
    assert server.metric("slipstream_requests_total", finish_reason="length") >= 1
    assert server.metric("slipstream_e2e_request_latency_seconds_count", **labels) >= 1
