"""Server-sent events: the streaming body every streaming endpoint shares; and a prefill leg's
KV handle for the router, as an event when streamed or a field of the JSON answer.

    Generation | Choices --stream_events(render, usage)--> data: {...} ... data: [DONE]

An engine failure mid-stream becomes an error event that ends the stream (the status line
already went out as 200); a prefill leg adds its KV handle, first as it starts and whole
once complete, as events of ``KV_TRANSFER_OBJECT`` that only the router reads.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.server.generation import Choices, Generation, engine_failure

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The ``object`` of the events a streamed prefill leg adds for the router (never a client's).
KV_TRANSFER_OBJECT = "slipstream.kv_transfer"


def sse_event(json_text: str) -> bytes:
    return b"data: " + json_text.encode() + b"\n\n"


async def stream_events(generation: Generation | Choices,
                        render: Callable[[RequestOutput], bytes],
                        usage: Callable[[RequestOutput], bytes] | None,
                        prelude: bytes = b"") -> AsyncIterator[bytes]:
    """The SSE body every streaming endpoint shares: ``prelude`` if any, ``render`` of each
    output that brings tokens or the finish, an engine failure as an error event (which ends
    the stream), the complete KV handle of a prefill leg that handed its KV off (an event of
    ``KV_TRANSFER_OBJECT``), then ``usage`` of the last output when asked for, then
    ``[DONE]``."""
    final: RequestOutput | None = None
    if prelude:
        yield prelude
    async with contextlib.aclosing(generation.__aiter__()) as outputs:
        async for output in outputs:
            final = output
            if output.finish_reason == "error":
                yield sse_event(json.dumps(engine_failure(output).body()))
                break
            if not output.new_token_ids and not output.finished:
                continue
            yield render(output)
    if final is not None and final.finished and final.kv_transfer is not None:
        yield sse_event(json.dumps({"object": KV_TRANSFER_OBJECT,
                                    "kv_transfer_params": final.kv_transfer}))
    if usage is not None and final is not None:
        yield usage(final)
    yield SSE_DONE


def with_kv_transfer(body: dict[str, Any], final: RequestOutput) -> dict[str, Any]:
    """A prefill instance's answer carries the handle of the KV it holds for a decode
    instance, as a top-level ``kv_transfer_params`` field (vLLM's name for it)."""
    if final.kv_transfer is not None:
        body["kv_transfer_params"] = final.kv_transfer
    return body



def kv_handle_event(choices: Choices, request_id: str) -> bytes:
    """A streamed prefill leg (``do_remote_decode``): its first event, before any token, is
    the streaming KV handle, so a router can start the decode leg while the prompt is still
    computing (the decode instance reads each chunk's blocks as they are done). Empty for
    every other request."""
    first = choices.generations[0].first
    if first.kv_transfer is None or first.finished:
        return b""
    return sse_event(json.dumps({"id": request_id, "object": KV_TRANSFER_OBJECT,
                                 "kv_transfer_params": first.kv_transfer}))
