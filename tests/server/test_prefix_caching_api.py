"""``usage.prompt_tokens_details.cached_tokens`` through the official ``openai`` client: 0 on a
fresh prompt, > 0 when the same prompt comes again, on both endpoints and in the streamed
usage chunk; the prefix-cache counters move with it."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.timeout(300)


def fresh_tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(length)]


def test_completions_report_cached_tokens_on_a_repeated_prompt(server):
    client = server.openai_client()
    prompt = fresh_tokens(1201, 150)
    hits_before = server.metric("slipstream_prefix_cache_hit_tokens_total")
    queries_before = server.metric("slipstream_prefix_cache_query_tokens_total")
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
    second = client.completions.create(model=server.model, prompt=prompt, max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 150
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 144  # 9 full 16-token blocks
    assert second.choices[0].text == first.choices[0].text
    assert server.metric("slipstream_prefix_cache_hit_tokens_total") == hits_before + 144
    assert server.metric("slipstream_prefix_cache_query_tokens_total") == queries_before + 300


def test_chat_reports_cached_tokens_and_streams_them_in_the_usage_chunk(server):
    client = server.openai_client()
    words = random.Random(1202).choices(["alpha", "beta", "gamma", "delta", "omega"], k=120)
    messages = [{"role": "system", "content": " ".join(words)},
                {"role": "user", "content": "What is the first word?"}]
    cold = client.chat.completions.create(model=server.model, messages=messages, max_tokens=3,
                                          temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(model=server.model, messages=messages,
                                            max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1
    cached = usage[0].prompt_tokens_details.cached_tokens
    assert 0 < cached < usage[0].prompt_tokens and cached % 16 == 0
    # A different question after the same system prompt reuses the shared part.
    follow_up = client.chat.completions.create(
        model=server.model, max_tokens=3, temperature=0,
        messages=[messages[0], {"role": "user", "content": "And the last one?"}])
    assert 0 < follow_up.usage.prompt_tokens_details.cached_tokens <= cached
