"""The client's answer when a disaggregated chain ends on its prefill instance.

    prefill leg's SSE events --PrefillEnd.add--> what the prefill said (answer, handle, error)
        ended at its first token --prefill_answer()--> the client's response, stream or not
    an unstreamed prefill leg's whole body --whole_answer()--> the same, from one JSON body

``disagg.py`` decides when the chain ends here; this module only shapes the response, in the
form the client asked for, exactly as a mixed instance would have sent it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response, StreamingResponse

from slipstream.agent.router.classify import CHAT
from slipstream.agent.router.proxy import BACKEND_HEADER, SSE_HEADERS
from slipstream.contracts.errors import APIError

PREFILL_BACKEND_HEADER = "x-slipstream-prefill-backend"


@dataclass
class PrefillEnd:
    """What a prefill leg's stream said, read to its end."""

    events: list[dict[str, Any]] = field(default_factory=list)  # the answer's own events
    handle: dict[str, Any] | None = None  # the complete KV handle of a hand-off
    error: dict[str, Any] | None = None  # an error event's ``error`` object

    def add(self, event: dict[str, Any]) -> None:
        if "error" in event:
            error = event["error"]
            self.error = error if isinstance(error, dict) else {"message": str(error)}
        elif "kv_transfer_params" in event:
            if isinstance(event["kv_transfer_params"], dict):
                self.handle = event["kv_transfer_params"]
        else:
            self.events.append(event)

    @property
    def finish_reason(self) -> str | None:
        reason = None
        for event in self.events:
            for choice in event.get("choices") or []:
                reason = choice.get("finish_reason") or reason
        return reason

    @property
    def handed_off(self) -> bool:
        """Whether a decode instance continues this request: a handle, and the first token
        did not end it (an agent that finds a stop string only after handing the KV off
        still ended the request there)."""
        return self.handle is not None and self.finish_reason == "length"



def prefill_answer(end: PrefillEnd, endpoint: str, stream: bool, body: dict[str, Any],
            prefill_backend: str) -> Response:
    """The prefill instance's own answer (the request ended at its first token), in the
    shape the client asked for: its events as they came if it streamed, else one body."""
    if not end.events:
        raise APIError(502, "the prefill instance ended its stream without an answer",
                       code="instance_failed")
    headers = {BACKEND_HEADER: prefill_backend, PREFILL_BACKEND_HEADER: prefill_backend}
    if stream:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = [_event(event) for event in end.events
                  if include_usage or event.get("choices") or not event.get("usage")]
        return StreamingResponse(_replay([*chunks, b"data: [DONE]\n\n"]),
                                 media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    head = end.events[0]
    common = {"id": head.get("id"), "created": head.get("created"), "model": head.get("model")}
    text: list[str] = []
    usage = None
    for event in end.events:
        usage = event.get("usage") or usage
        for item in event.get("choices") or []:
            piece = (item.get("delta") or {}).get("content") if endpoint == CHAT \
                else item.get("text")
            text.append(piece or "")
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": end.finish_reason}
    answer: dict[str, Any]
    if endpoint == CHAT:
        answer = {**common, "object": "chat.completion",
                  "choices": [{**choice, "message": {"role": "assistant",
                                                     "content": "".join(text)}}]}
    else:
        answer = {**common, "object": "text_completion",
                  "choices": [{**choice, "text": "".join(text)}]}
    answer["usage"] = usage
    return Response(json.dumps(answer), media_type="application/json", headers=headers)


async def _replay(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def whole_answer(answer: dict[str, Any], endpoint: str, stream: bool, body: dict[str, Any],
              prefill_backend: str) -> Response:
    """A whole prefill answer (the unstreamed fallback), in the shape the client asked for."""
    headers = {BACKEND_HEADER: prefill_backend, PREFILL_BACKEND_HEADER: prefill_backend}
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
