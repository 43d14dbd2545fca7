"""n > 1, penalties, logit_bias, echo and user, through real HTTP with the official client."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_n_greedy_choices_are_identical(layout_server):
    server = layout_server
    result = server.openai_client().chat.completions.create(
        model=server.model, messages=MESSAGES, n=3, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True})
    assert [choice.index for choice in result.choices] == [0, 1, 2]
    texts = {choice.message.content for choice in result.choices}
    assert len(texts) == 1 and texts != {""}
    # The prompt counts once, the completions of every choice add up.
    single = server.openai_client().chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True})
    assert result.usage.prompt_tokens == single.usage.prompt_tokens
    assert result.usage.completion_tokens == 30


def test_n_sampled_choices_differ_and_seeded_ones_repeat(layout_server):
    server = layout_server
    client = server.openai_client()

    def texts(**kwargs):
        result = client.chat.completions.create(
            model=server.model, messages=MESSAGES, n=3, max_tokens=16, temperature=1.0,
            extra_body={"ignore_eos": True}, **kwargs)
        return [choice.message.content for choice in result.choices]

    unseeded = texts()
    assert len(set(unseeded)) == 3
    seeded = texts(seed=7)
    assert len(set(seeded)) == 3  # each choice has its own seed stream
    assert texts(seed=7) == seeded
    # Choice 0 of a seeded request is exactly the n=1 request with that seed.
    alone = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True})
    assert alone.choices[0].message.content == seeded[0]


def test_n_streamed_choices_each_get_role_text_and_finish(layout_server):
    server = layout_server
    stream = server.openai_client().chat.completions.create(
        model=server.model, messages=MESSAGES, n=2, max_tokens=8, temperature=0.8, seed=3,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    roles, texts, finishes = {}, {0: "", 1: ""}, {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert finishes == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 16
    blocking = server.openai_client().chat.completions.create(
        model=server.model, messages=MESSAGES, n=2, max_tokens=8, temperature=0.8, seed=3,
        extra_body={"ignore_eos": True})
    assert [texts[0], texts[1]] == [c.message.content for c in blocking.choices]


def test_completion_n_and_echo(server):
    client = server.openai_client()
    prompt = "Once upon a time"
    result = client.completions.create(model=server.model, prompt=prompt, n=2, max_tokens=6,
                                       temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in result.choices] == [prompt + plain.choices[0].text] * 2
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=server.model, prompt=prompt, max_tokens=6, temperature=0, echo=True,
        stream=True, extra_body={"ignore_eos": True}) if chunk.choices)
    assert streamed == prompt + plain.choices[0].text


def test_logit_bias_and_penalties_reach_the_sampler(layout_server):
    server = layout_server
    client = server.openai_client()
    target = 300  # an ordinary BPE token of the tiny tokenizer
    forced = client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                       temperature=0.7, logit_bias={str(target): 100},
                                       logprobs=0, extra_body={"ignore_eos": True})
    greedy = client.completions.create(model=server.model, prompt="Hello", max_tokens=4,
                                       temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True})
    forced_tokens = forced.choices[0].logprobs.tokens
    assert len(forced_tokens) == 4 and len(set(forced_tokens)) == 1
    assert forced_tokens != greedy.choices[0].logprobs.tokens
    penalised = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=24, temperature=0,
        presence_penalty=2.0, frequency_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    plain = client.completions.create(model=server.model, prompt="Hello", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert penalised.choices[0].text != plain.choices[0].text


def test_user_is_accepted_as_the_fairness_tenant(server):
    result = server.openai_client().chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=3, user="alice")
    assert result.choices[0].message.content is not None


def test_openapi_document_describes_the_request_fields(server):
    import httpx

    document = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for field in ("n", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                  "response_format", "tools", "tool_choice", "parallel_tool_calls",
                  "repetition_penalty"):
        assert field in chat, field
    assert "echo" in schemas["CompletionRequest"]["properties"]
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ChatCompletionRequest")
    assert "ResponseFormat" in schemas and "ToolSpec" in schemas


def test_n_choices_compute_the_prompt_once(layout_server):
    server = layout_server  # each engine layout: the same over the engine core's wire
    # A prompt no earlier test sent, so only this request's choices can hit the cache.
    words = ["river", "lantern", "copper", "meadow", "orbit", "velvet", "signal", "harbor"]
    prompt = " ".join(words[(i * 5 + 3) % len(words)] + str(i) for i in range(60))
    queries = server.metric("slipstream_prefix_cache_query_tokens_total")
    hits = server.metric("slipstream_prefix_cache_hit_tokens_total")
    result = server.openai_client().completions.create(
        model=server.model, prompt=prompt, n=4, max_tokens=4, temperature=1.0,
        extra_body={"ignore_eos": True})
    assert len(result.choices) == 4
    prompt_tokens = result.usage.prompt_tokens
    assert prompt_tokens > 2 * 16
    # Choice 0 computes the prompt; the other three wait for it and take its full blocks from
    # the cache (all but the block of the last prompt token, which each computes itself).
    shared = (prompt_tokens - 1) // 16 * 16
    assert server.wait_for_metric("slipstream_prefix_cache_query_tokens_total",
                                  queries + 4 * prompt_tokens) == queries + 4 * prompt_tokens
    assert server.metric("slipstream_prefix_cache_hit_tokens_total") - hits == 3 * shared
