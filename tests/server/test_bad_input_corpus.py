"""A corpus of bad input (well over 150 cases) sent to both endpoints of a real server, and
through a real router in front of it. Every case must get a 200 or a 4xx in OpenAI's error
shape, with no exception text; afterwards the server is healthy, serves a normal request, and
its KV cache is back at its baseline (nothing leaked)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny-test"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
VALID = {
    COMPLETIONS: {"model": MODEL, "prompt": "hello there", "max_tokens": 2},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
# Values of every JSON type, and the edge of each.
ODD_VALUES = {
    "string": "10", "empty string": "", "true": True, "false": False, "zero": 0,
    "negative": -1, "float": 0.5, "huge int": 10**30, "huge float": 1e308, "list": [1],
    "empty list": [], "object": {"a": 1}, "empty object": {},
}
FIELDS = {
    COMPLETIONS: ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                  "stop_token_ids", "n", "stream", "stream_options", "logprobs", "echo",
                  "ignore_eos", "priority", "app_id", "slo", "model", "user", "logit_bias"],
    CHAT: ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "temperature",
           "stream", "stop"],
}
DEEP = 100_000


def _raw(text: str) -> bytes:
    return text.encode()


def raw_cases(path: str) -> list[tuple[str, bytes]]:
    valid = json.dumps(VALID[path])
    prompt_key = "prompt" if path == COMPLETIONS else "messages"
    def with_value(value_json: str) -> bytes:
        return _raw(valid[:-1] + f', "{prompt_key}": {value_json}}}')
    surrogate_value = ('"\\ud800 alone"' if path == COMPLETIONS
                       else '[{"role": "user", "content": "\\udfff alone"}]')
    return [
        ("empty body", b""),
        ("whitespace body", b"   \n"),
        ("truncated", _raw(valid[:-5])),
        ("trailing garbage", _raw(valid + "xyz")),
        ("two objects", _raw(valid + valid)),
        ("top-level array", b"[1, 2]"),
        ("top-level string", b'"hello"'),
        ("top-level number", b"42"),
        ("top-level null", b"null"),
        ("invalid utf-8", b'{"prompt": "\xff\xfe"}'),
        ("utf-8 bom", b"\xef\xbb\xbf" + _raw(valid)),
        ("NaN literal", _raw(valid[:-1] + ', "temperature": NaN}')),
        ("Infinity literal", _raw(valid[:-1] + ', "temperature": Infinity}')),
        ("-Infinity literal", _raw(valid[:-1] + ', "top_p": -Infinity}')),
        ("number overflow", _raw(valid[:-1] + ', "temperature": 1e400}')),
        ("deep arrays", _raw('{"prompt": ' + "[" * DEEP + "]" * DEEP + "}")),
        ("deep objects", _raw('{"slo": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}")),
        ("deep in messages", _raw('{"messages": [{"role": "user", "content": '
                                  + "[" * 5000 + "]" * 5000 + "}]}")),
        ("moderately deep prompt", with_value("[" * 500 + "1" + "]" * 500)),
        ("lone surrogate in prompt", with_value(surrogate_value)),
        ("lone surrogate in model", _raw(valid[:-1] + ', "model": "\\ud83d"}')),
        ("lone surrogate in key", _raw(valid[:-1] + ', "\\udc00": 1}')),
        ("lone surrogate in stop", _raw(valid[:-1] + ', "stop": ["\\ud800"]}')),
        ("surrogate pair is fine", with_value('"smile \\ud83d\\ude00"' if path == COMPLETIONS
                                              else '[{"role": "user", "content": '
                                                   '"smile \\ud83d\\ude00"}]')),
        ("escaped backslash-u is text", with_value('"\\\\ud800"' if path == COMPLETIONS
                                                   else '[{"role": "user", "content": '
                                                        '"\\\\ud800"}]')),
        ("nul character", with_value('"a\\u0000b"' if path == COMPLETIONS
                                     else '[{"role": "user", "content": "a\\u0000b"}]')),
        ("duplicate keys", _raw(valid[:-1] + ', "max_tokens": 3, "max_tokens": -3}')),
        ("unknown field", _raw(valid[:-1] + ', "frobnicate": 1}')),
        ("very long model name", _raw(valid[:-1] + ', "model": "' + "m" * 100_000 + '"}')),
        ("very long unknown key", _raw(valid[:-1] + ', "' + "k" * 100_000 + '": 1}')),
    ]


def field_cases(path: str) -> list[tuple[str, bytes]]:
    cases = []
    for field in FIELDS[path]:
        for name, value in ODD_VALUES.items():
            body = {**VALID[path], field: value}
            if field == "stream" and value is True:
                continue  # a valid stream; covered elsewhere
            cases.append((f"{field}={name}", json.dumps(body).encode()))
    return cases


def message_cases() -> list[tuple[str, bytes]]:
    bad_messages = {
        "message not an object": ["hi"],
        "message without role": [{"content": "hi"}],
        "role is a number": [{"role": 1, "content": "hi"}],
        "content is a number": [{"role": "user", "content": 5}],
        "content is an object": [{"role": "user", "content": {"text": "hi"}}],
        "content part without type": [{"role": "user", "content": [{"text": "hi"}]}],
        "content part text not a string": [{"role": "user", "content": [
            {"type": "text", "text": 5}]}],
        "content parts nested": [{"role": "user", "content": [[{"type": "text"}]]}],
        "assistant first then nothing": [{"role": "assistant", "content": "x"}],
        "tool message": [{"role": "tool", "content": "x"}],
        "many messages": [{"role": "user", "content": "x"}] * 500,
        "null content": [{"role": "user", "content": None}],
    }
    return [(name, json.dumps({**VALID[CHAT], "messages": messages}).encode())
            for name, messages in bad_messages.items()]


def all_cases() -> list[tuple[str, str, bytes]]:
    cases = [(COMPLETIONS, name, raw) for name, raw in raw_cases(COMPLETIONS)]
    cases += [(CHAT, name, raw) for name, raw in raw_cases(CHAT)]
    cases += [(COMPLETIONS, name, raw) for name, raw in field_cases(COMPLETIONS)]
    cases += [(CHAT, name, raw) for name, raw in field_cases(CHAT)]
    cases += [(CHAT, name, raw) for name, raw in message_cases()]
    return cases


def check_answer(path: str, name: str, response: httpx.Response) -> str:
    """The answer is a 200 or a 4xx in OpenAI's error shape that leaks nothing internal."""
    where = f"{path} {name}: {response.status_code} {response.text[:300]}"
    assert response.status_code == 200 or 400 <= response.status_code < 500, where
    if response.status_code == 200:
        return "ok"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, where
    assert isinstance(error["message"], str) and error["message"], where
    for leak in ("Traceback", "RecursionError", "UnicodeEncodeError", "File \"", "Exception"):
        assert leak not in error["message"], where
    return str(response.status_code)


def run_corpus(base_url: str) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for path, name, raw in all_cases():
            response = client.post(path, content=raw,
                                   headers={"content-type": "application/json"})
            outcome = check_answer(path, name, response)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def assert_healthy_and_clean(server) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    client = server.openai_client(timeout=60)
    answer = client.completions.create(model=MODEL, prompt="still fine?", max_tokens=3)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert server.wait_for_metric("slipstream_kv_cache_blocks_used", 0.0) == 0.0


def test_the_corpus_is_large_enough():
    cases = all_cases()
    assert len(cases) >= 150
    assert len({(path, name) for path, name, _ in cases}) == len(cases)


def test_every_bad_input_gets_a_clean_answer_from_the_server(server):
    baseline = server.metric("slipstream_kv_cache_blocks_used")
    assert baseline == 0.0
    started = time.monotonic()
    outcomes = run_corpus(server.base_url)
    elapsed_s = time.monotonic() - started
    print(f"\ncorpus against the server: {sum(outcomes.values())} cases, outcomes {outcomes}, "
          f"{elapsed_s:.1f} s")
    assert "ok" in outcomes and "400" in outcomes
    assert_healthy_and_clean(server)


def test_every_bad_input_gets_a_clean_answer_through_the_router(server, run_router,
                                                                 tiny_model_dir, tmp_path):
    with run_router(tiny_model_dir, tmp_path, [f"{server.base_url}=short"]) as router:
        outcomes = run_corpus(router.base_url)
        print(f"\ncorpus through the router: {sum(outcomes.values())} cases, outcomes "
              f"{outcomes}")
        assert httpx.get(f"{router.base_url}/health", timeout=10).status_code == 200
    assert "ok" in outcomes and "400" in outcomes
    assert_healthy_and_clean(server)
