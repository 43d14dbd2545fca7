"""Chaining a prefill instance and a decode instance into one response for the client.

    client --> router --classify--> prefill leg: POST to a prefill instance (its pool, as
                                    always), stream=false, kv_transfer_params:
                                    {"do_remote_decode": true}
                                    <-- first token + kv_transfer_params (the KV handle)
                      --> decode leg: the client's own body + the handle, to the decode
                                    instance with the least KV held (then fewest requests);
                                    it fetches the KV, emits the first token and continues
                      <-- the decode instance's answer, passed through (stream or not)

The client sees one response, exactly as from a mixed instance. Both legs go through the
``Proxy``, so each is retried on another instance when it never ran there (no connection, or
a 503: for a decode instance that includes a KV fetch that failed). If the decode leg still
cannot be placed, the whole chain is tried once more from a new prefill; after that, and
after any failure past the first token, the client gets a clean error (an SSE error event
once a stream has started).

A request that ends at its first token (EOS, a stop string, ``max_tokens: 1``) never reaches
a decode instance: the prefill instance's answer is returned (as a one-event stream if the
client streamed). Requests that ask for logprobs or echo are served whole by a prefill
instance: a decode instance does not have the first token's log-probabilities.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse

from slipstream.agent.router.classify import CHAT, RoutedRequest
from slipstream.agent.router.config import DECODE_POOL
from slipstream.agent.router.instances import InstanceTable
from slipstream.agent.router.proxy import SSE_HEADERS, Proxy
from slipstream.agent.server.errors import APIError

log = logging.getLogger(__name__)
PREFILL_BACKEND_HEADER = "x-slipstream-prefill-backend"
CHAIN_ATTEMPTS = 2  # the first try, and one retry of the whole chain


def chainable(body: Any) -> bool:
    """Whether a request can be split into a prefill and a decode leg."""
    if not isinstance(body, dict):
        return False  # the prefill instance answers with the precise 400
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        return False
    return not body.get("kv_transfer_params")  # a client driving the legs itself


class DisaggChain:
    def __init__(self, proxy: Proxy, table: InstanceTable) -> None:
        self._proxy = proxy
        self._table = table

    async def forward(self, path: str, endpoint: str, body: dict[str, Any],
                      headers: dict[str, str], routed: RoutedRequest) -> Response:
        prefill_body = {key: value for key, value in body.items() if key != "stream_options"}
        prefill_body.update(stream=False, kv_transfer_params={"do_remote_decode": True})
        prefill_raw = json.dumps(prefill_body).encode()
        prefill_routed = dataclasses.replace(routed, stream=False)
        decode_routed = dataclasses.replace(routed, request_class=DECODE_POOL)
        self._table.observe_prompt(DECODE_POOL, routed.prompt_tokens)
        for attempt in range(CHAIN_ATTEMPTS):
            prefill = await self._proxy.forward(path, prefill_raw, headers, prefill_routed)
            prefill_backend = prefill.headers.get("x-slipstream-backend", "")
            if prefill.status_code >= 400:
                return prefill  # the client's error (a 400), or no prefill instance at all
            answer = json.loads(bytes(prefill.body))
            handle = answer.pop("kv_transfer_params", None)
            if handle is None:  # finished at its first token
                return _finished(answer, endpoint, routed.stream, body, prefill_backend)
            decode_body = {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True}}
            try:
                response = await self._proxy.forward(path, json.dumps(decode_body).encode(),
                                                     headers, decode_routed)
            except APIError as error:
                if error.status_code != 503 or attempt + 1 == CHAIN_ATTEMPTS:
                    raise
                log.warning("no decode instance took the request (%s); retrying the chain "
                            "from a new prefill", error.message)
                continue
            response.headers[PREFILL_BACKEND_HEADER] = prefill_backend
            return response
        raise AssertionError("unreachable: the last attempt returns or raises")


def _finished(answer: dict[str, Any], endpoint: str, stream: bool, body: dict[str, Any],
              prefill_backend: str) -> Response:
    """The prefill instance's complete answer, in the shape the client asked for."""
    headers = {"x-slipstream-backend": prefill_backend, PREFILL_BACKEND_HEADER: prefill_backend}
    if not stream:
        return Response(json.dumps(answer), media_type="application/json", headers=headers)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_as_stream(answer, endpoint, include_usage),
                             media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


async def _as_stream(answer: dict[str, Any], endpoint: str,
                     include_usage: bool) -> AsyncIterator[bytes]:
    common = {"id": answer.get("id"), "created": answer.get("created"),
              "model": answer.get("model")}
    choice = (answer.get("choices") or [{}])[0]
    if endpoint == CHAT:
        common["object"] = "chat.completion.chunk"
        message = choice.get("message") or {}
        yield _event({**common, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "finish_reason": None}]})
        yield _event({**common, "choices": [{"index": 0,
                                             "delta": {"content": message.get("content") or ""},
                                             "finish_reason": choice.get("finish_reason")}]})
    else:
        common["object"] = "text_completion"
        yield _event({**common, "choices": [{"index": 0, "text": choice.get("text") or "",
                                             "logprobs": None,
                                             "finish_reason": choice.get("finish_reason")}]})
    if include_usage and answer.get("usage") is not None:
        yield _event({**common, "choices": [], "usage": answer["usage"]})
    yield b"data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"
