"""Bad requests get an OpenAI-shaped 4xx, and the server keeps serving the next request."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_MESSAGE = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return {"model": "tiny-test", "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": "tiny-test", "messages": USER_MESSAGE, "max_tokens": 4, **fields}


# (case id, path, JSON body or raw bytes, expected status, expected "param" or None)
BAD_REQUESTS = [
    ("malformed json", COMPLETIONS, b'{"prompt": "x",', 400, None),
    ("nan literal", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("body not an object", COMPLETIONS, [1, 2, 3], 400, None),
    ("missing prompt", COMPLETIONS, {"model": "tiny-test"}, 400, "prompt"),
    ("unknown model", COMPLETIONS, completion(model="gpt-17"), 404, "model"),
    ("unknown model chat", CHAT, chat(model="gpt-17"), 404, "model"),
    ("negative max_tokens", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    ("zero max_tokens", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", COMPLETIONS, completion(max_tokens=10**12), 400, "max_tokens"),
    ("non-integer max_tokens", COMPLETIONS, completion(max_tokens="many"), 400, "max_tokens"),
    ("negative max_completion_tokens", CHAT, chat(max_completion_tokens=-5), 400,
     "max_completion_tokens"),
    ("prompt longer than context", COMPLETIONS,
     completion(prompt=list(range(10, 10 + 2100))), 400, "prompt"),
    ("prompt fills context", COMPLETIONS, completion(prompt=[7] * 2048), 400, "prompt"),
    ("prompt plus max_tokens over context", COMPLETIONS,
     completion(prompt=[7] * 2000, max_tokens=100), 400, "max_tokens"),
    ("token id outside vocabulary", COMPLETIONS, completion(prompt=[1, 10**9]), 400, "prompt"),
    ("negative token id", COMPLETIONS, completion(prompt=[1, -3]), 400, "prompt"),
    ("empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    ("batched prompts", COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt"),
    ("negative temperature", COMPLETIONS, completion(temperature=-1), 400, "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_k zero", COMPLETIONS, completion(top_k=0), 400, "top_k"),
    ("too many logprobs", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("n above the limit", CHAT, chat(n=17), 400, "n"),
    ("presence_penalty out of range", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("repetition_penalty zero", COMPLETIONS, completion(repetition_penalty=0), 400,
     "repetition_penalty"),
    ("logit_bias out of range", CHAT, chat(logit_bias={"5": 300}), 400, "logit_bias"),
    ("logit_bias token outside vocabulary", COMPLETIONS,
     completion(logit_bias={str(10**9): 1}), 400, None),
    ("echo with logprobs", COMPLETIONS, completion(echo=True, logprobs=2), 400, "echo"),
    ("empty stop string", COMPLETIONS, completion(stop=[""]), 400, None),
    ("empty message list", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role"),
    ("image content", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages.0.content"),
    ("unknown field", COMPLETIONS, completion(ttft_slo_s=1.0), 400, "ttft_slo_s"),
    ("negative slo", CHAT, chat(slo={"ttft_s": -2}), 400, "slo.ttft_s"),
    ("stream on bad request", CHAT, chat(stream=True, max_tokens=10**9), 400, "max_tokens"),
    # The handle crosses to the engine core as msgpack (64-bit integers): found by the
    # schemathesis fuzz test as a 500.
    ("huge int in kv_transfer_params", CHAT,
     chat(kv_transfer_params={"a": {"b": [1, -6 * 10**33]}}), 400, "kv_transfer_params"),
    ("int past uint64 in kv_transfer_params", COMPLETIONS,
     completion(kv_transfer_params={"n": 2**64}), 400, "kv_transfer_params"),
]


def _post(server, path, body):
    if isinstance(body, bytes):
        return httpx.post(server.base_url + path, content=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    return httpx.post(server.base_url + path, json=body, timeout=30)


def _assert_openai_error(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("path, body, status, param",
                         [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_openai_error_and_server_keeps_serving(server, path, body, status,
                                                                param):
    _assert_openai_error(_post(server, path, body), status, param)
    follow_up = _post(server, path, chat() if path == CHAT else completion())
    assert follow_up.status_code == 200, follow_up.text
    assert follow_up.json()["usage"]["completion_tokens"] >= 1


def test_unknown_route_and_wrong_method_use_openai_shape(server):
    missing = httpx.get(f"{server.base_url}/v1/embeddings")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = httpx.get(f"{server.base_url}/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_openai_client_maps_errors_to_its_exceptions(server):
    client = server.openai_client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="missing-model", messages=USER_MESSAGE)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as context_error:
        client.completions.create(model=server.model, prompt=[3] * 5000, max_tokens=1)
    assert "context length" in context_error.value.message
    assert client.completions.create(model=server.model, prompt="ok", max_tokens=1).choices
