"""Request validation of the OpenAI-compatible API, without a server: which inputs are
accepted, how they are normalised, and which field an error names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from slipstream.contracts.errors import from_validation_error
from slipstream.agent.server.protocol import ChatCompletionRequest, CompletionRequest
from slipstream.agent.server.responses import ChatChunkChoice, ChatDelta


def _error(model, data) -> dict:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(data)
    return from_validation_error(caught.value).body()["error"]


@pytest.mark.parametrize("prompt, expected", [
    ("hello", "hello"),
    ([1, 2, 3], [1, 2, 3]),
    (["only one"], "only one"),
    ([[4, 5]], [4, 5]),
])
def test_single_prompt_forms_are_normalised(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("prompt, words", [
    (["a", "b"], "batched prompts"),
    ("", "must not be empty"),
    ([], "must not be empty"),
    ([1, True], "integer token ids"),
    ([{"x": 1}], "integer token ids"),
    ([3, -1], "non-negative"),
])
def test_bad_prompts_name_the_field(prompt, words):
    error = _error(CompletionRequest, {"prompt": prompt})
    assert error["param"] == "prompt"
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_unknown_fields_are_rejected_by_name():
    error = _error(CompletionRequest, {"prompt": "x", "tpot_slo_ms": 50})
    assert error["param"] == "tpot_slo_ms"
    assert error["message"] == "Unrecognized request argument supplied: tpot_slo_ms"


def test_slipstream_extras_are_parsed():
    request = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "priority": 3, "app_id": "search",
        "ignore_eos": True, "top_k": 5, "slo": {"ttft_s": 1.5, "tpot_ms": 40}})
    assert (request.priority, request.app_id, request.ignore_eos, request.top_k) == \
        (3, "search", True, 5)
    assert request.slo.ttft_s == 1.5 and request.slo.tpot_ms == 40


@pytest.mark.parametrize("data, param", [
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"the": 5}}, "logit_bias"),
    ({"slo": {"ttft_s": 0}}, "slo.ttft_s"),
    ({"slo": {"deadline": 1}}, "slo.deadline"),
    ({"temperature": "hot"}, "temperature"),
    ({"frequency_penalty": "lots"}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"best_of": 3}, "best_of"),
])
def test_unsupported_or_invalid_values_name_their_field(data, param):
    assert _error(CompletionRequest, {"prompt": "x", **data})["param"] == param


def test_chat_needs_messages_with_text_content():
    assert _error(ChatCompletionRequest, {"messages": []})["param"] == "messages"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
    error = _error(ChatCompletionRequest, {"messages": [image]})
    assert error["param"] == "messages.0.content" and "text" in error["message"]


def test_chat_text_parts_are_joined_and_max_completion_tokens_wins():
    request = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 10, "max_completion_tokens": 3})
    assert request.messages[0].text() == "ab"
    assert request.requested_max_tokens == 3


def test_chat_logprob_settings():
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(base).num_logprobs is None
    assert ChatCompletionRequest.model_validate({**base, "logprobs": True}).num_logprobs == 0
    assert ChatCompletionRequest.model_validate(
        {**base, "logprobs": True, "top_logprobs": 4}).num_logprobs == 4


def test_stream_delta_omits_absent_fields_like_openai():
    assert ChatDelta().model_dump() == {}
    choice = ChatChunkChoice(delta=ChatDelta(content="hi")).model_dump()
    assert choice == {"index": 0, "delta": {"content": "hi"}, "logprobs": None,
                      "finish_reason": None}


def test_user_names_the_tenant_when_app_id_is_absent():
    from types import SimpleNamespace

    from slipstream.agent.server.config import ServerConfig
    from slipstream.agent.server.prepare import prepare

    ctx = SimpleNamespace(engine=SimpleNamespace(max_model_len=64), config=ServerConfig())

    def tenant(**fields):
        body = CompletionRequest.model_validate({"prompt": "x", **fields})
        return prepare(ctx, "id", body, [1, 2], max_tokens=4, logprobs=None,
                       prompt_param="prompt").request.app_id

    assert tenant() == "default"
    assert tenant(user="alice") == "alice"
    assert tenant(user="alice", app_id="search") == "search"


def test_choices_get_their_own_ids_and_seed_streams():
    from types import SimpleNamespace

    from slipstream.agent.server.config import ServerConfig
    from slipstream.agent.server.prepare import prepare

    ctx = SimpleNamespace(engine=SimpleNamespace(max_model_len=64), config=ServerConfig())
    body = CompletionRequest.model_validate({"prompt": "x", "n": 3, "seed": 2**63 - 1,
                                             "presence_penalty": 0.5,
                                             "logit_bias": {"7": -100}})
    choices = prepare(ctx, "cmpl-1", body, [1, 2], max_tokens=4, logprobs=None,
                      prompt_param="prompt").choices()
    assert [c.request_id for c in choices] == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    seeds = [c.params.seed for c in choices]
    assert seeds[0] == 2**63 - 1 and len(set(seeds)) == 3
    assert all(-(2**63) <= seed < 2**63 for seed in seeds)
    assert all(c.params.presence_penalty == 0.5 and c.params.logit_bias == ((7, -100.0),)
               for c in choices)
