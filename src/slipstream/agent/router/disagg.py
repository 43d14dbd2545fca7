"""Chaining a prefill instance and a decode instance into one response for the client.

    client --> router --classify--> prefill leg: POST to a prefill instance (its pool, as
                                    always), stream=true, kv_transfer_params:
                                    {"do_remote_decode": true}
                                    <-- first event: the streaming KV handle (before any token)
                      --> decode leg, started at once: the client's own body + the handle, to
                                    the decode instance with the least KV held (then fewest
                                    requests); it reads each prompt block as the prefill
                                    instance computes it, and continues from the first token
                          meanwhile the router reads the prefill stream to its end: the
                          first token and, for a hand-off, the complete handle
                      <-- the decode instance's answer, passed through (stream or not)

So the KV transfer overlaps the prefill of the later chunks of the same prompt through the
router too (the decode instance's ``slipstream_kv_transfer_overlapped_blocks_total`` counts
the blocks it read early). The client sees one response, exactly as from a mixed instance.

How a chain ends otherwise, with nothing left behind on either instance:

- The prefill ends at its first token (EOS, a stop string, ``max_tokens: 1``): the decode leg
  is cancelled (its instance aborts the request, frees its blocks and acknowledges, so the
  prefill instance frees its hold) and the client gets the prefill instance's answer, as a
  stream if it streamed.
- The prefill fails, or its instance is lost: the decode leg is cancelled; a failure that
  says the request never ran (503 codes: drained, shutting down) retries the whole chain once
  from a new prefill, anything else is the client's error (nothing has been sent yet, so it
  is a real HTTP error status).
- The decode leg fails while the prefill still runs: the prefill stream is closed (its
  instance aborts the request and drops its hold). A 503 (no decode instance, or a KV fetch
  that failed) retries the whole chain once.
- The client goes away: both legs are closed at once, mid-prompt included.

Fallback: a prefill instance whose first event is not a streaming handle (an agent that sends
its handle only with its answer) is read to its end and the decode leg starts then, with the
complete handle; one that refuses a streamed prefill leg (an agent from before streamed
hand-offs: a 400 on ``stream``) gets the request again with ``stream=false``, as before.

No decode instance: while the table knows decode instances but none can take a leg (all
cooling down after failures, refusing, or silent), a request is not chained: a prefill or
mixed instance serves it whole, as a plain request (both roles serve those). A chain that
fails its last attempt with a retryable error (a 503: the decode pool refused or is gone) is
served whole the same way rather than refused. Every chain attempt that fails after the
prefill instance opened a hold releases that hold at once (``kv_release.py``), so nothing
waits for the hold timeout.

Both legs go through the ``Proxy``, so each is retried on another instance when it never ran
there (no connection, or a 503). After the first token, the client gets a clean error (an SSE
error event once a stream has started). Requests that ask for logprobs or echo are served
whole by a prefill instance: a decode instance does not have the first token's
log-probabilities.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi.responses import Response
from starlette.requests import Request

from slipstream.agent.engine.errors import (
    DRAINED, INVALID_REQUEST, KV_TRANSFER_FAILED, SHUTTING_DOWN)
from slipstream.agent.router.classify import RoutedRequest
from slipstream.agent.router.config import DECODE_POOL
from slipstream.agent.router.disagg_answers import (
    PREFILL_BACKEND_HEADER, PrefillEnd, prefill_answer, whole_answer)
from slipstream.agent.router.instances import InstanceTable
from slipstream.agent.router.kv_release import release_hold
from slipstream.agent.router.proxy import BACKEND_HEADER, Proxy, discard
from slipstream.agent.router.upstream_events import EventStream
from slipstream.contracts.errors import APIError

log = logging.getLogger(__name__)
# On a response a prefill or mixed instance served whole although decode instances are
# known: why the request was not chained.
SERVED_WHOLE_HEADER = "x-slipstream-served-whole"
CHAIN_ATTEMPTS = 2  # the first try, and one retry of the whole chain
# Error codes in a prefill stream's error event that say the request never ran there.
_RETRY_CODES = frozenset({DRAINED, SHUTTING_DOWN, KV_TRANSFER_FAILED, "engine_unavailable",
                          "no_instance_available"})
# A decode leg that failed because the hold it reads is gone: how long to wait for the
# prefill stream's end, which tells a request that ended at its first token (the prefill
# dropped its hold) from a failed transfer.
HOLD_GONE_GRACE_S = 5.0
CLIENT_CLOSED_STATUS = 499  # nginx's name for it; nobody reads it, the client is gone


def chainable(body: Any) -> bool:
    """Whether a request can be split into a prefill and a decode leg."""
    if not isinstance(body, dict):
        return False  # the prefill instance answers with the precise 400
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        return False
    return not body.get("kv_transfer_params")  # a client driving the legs itself


@dataclass
class _Holds:
    """The KV holds one chain attempt opened: (prefill instance URL, transfer id)."""

    opened: set[tuple[str, str]] = field(default_factory=set)

    def saw(self, instance_url: str, handle: Any) -> None:
        if isinstance(handle, dict) and isinstance(handle.get("transfer_id"), str):
            self.opened.add((instance_url, handle["transfer_id"]))


class _Retry(Exception):
    """This try of the chain failed before the client saw anything; a new one may succeed."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class DisaggChain:
    def __init__(self, proxy: Proxy, table: InstanceTable) -> None:
        self._proxy = proxy
        self._table = table

    async def forward(self, path: str, endpoint: str, body: dict[str, Any],
                      headers: dict[str, str], routed: RoutedRequest,
                      request: Request | None = None) -> Response:
        """The chain for one request; with ``request``, a client that leaves before the
        answer starts closes both legs at once (mid-prompt included)."""
        work = self._forward(path, endpoint, body, headers, routed)
        if request is None:
            return await work
        return await _until_disconnect(request, work)

    async def _forward(self, path: str, endpoint: str, body: dict[str, Any],
                       headers: dict[str, str], routed: RoutedRequest) -> Response:
        self._table.observe_prompt(DECODE_POOL, routed.prompt_tokens)
        for attempt in range(CHAIN_ATTEMPTS):
            if not self._table.decode_available():
                return await self._whole(path, body, headers, routed)
            holds = _Holds()
            try:
                return await self._try(path, endpoint, body, headers, routed, holds)
            except _Retry as retry:
                await self._release(holds, headers)
                if attempt + 1 == CHAIN_ATTEMPTS:
                    log.warning("the chain failed before its first token (%s); serving the "
                                "request whole", retry.error.message)
                    return await self._whole(path, body, headers, routed)
                log.warning("the chain failed before its first token (%s); retrying it from "
                            "a new prefill", retry.error.message)
            except BaseException:
                await self._release(holds, headers)
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _whole(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     routed: RoutedRequest) -> Response:
        """The request as a plain one on a prefill or mixed instance: no hand-off."""
        response = await self._proxy.forward(path, json.dumps(body).encode(), headers, routed)
        response.headers[SERVED_WHOLE_HEADER] = "no-decode-instance"
        return response

    async def _release(self, holds: _Holds, headers: dict[str, str]) -> None:
        """Free what a failed attempt left held (after a hand-off that worked, the decode
        instance acknowledges it instead)."""
        with anyio.CancelScope(shield=True):
            for instance_url, transfer_id in holds.opened:
                await release_hold(self._proxy.client, instance_url, transfer_id, headers)

    async def _try(self, path: str, endpoint: str, body: dict[str, Any],
                   headers: dict[str, str], routed: RoutedRequest, holds: _Holds) -> Response:
        prefill_body = {**body, "stream": True, "stream_options": {"include_usage": True},
                        "kv_transfer_params": {"do_remote_decode": True}}
        opened = await self._proxy.open_stream(path, json.dumps(prefill_body).encode(), headers,
                                               dataclasses.replace(routed, stream=True))
        if isinstance(opened, Response):
            if _refuses_streamed_prefill(opened):
                return await self._try_unstreamed(path, endpoint, body, headers, routed,
                                                  holds)
            return opened  # the client's error (a 400), as the prefill instance put it
        try:
            async with contextlib.aclosing(opened.events()) as events:
                return await self._chain(path, endpoint, body, headers, routed, opened, events,
                                         holds)
        finally:
            with anyio.CancelScope(shield=True):
                await opened.aclose()

    async def _chain(self, path: str, endpoint: str, body: dict[str, Any],
                     headers: dict[str, str], routed: RoutedRequest, opened: EventStream,
                     events: AsyncIterator[dict[str, Any]], holds: _Holds) -> Response:
        first = await anext(events, None)
        early = first.get("kv_transfer_params") if first is not None else None
        holds.saw(opened.instance_url, early)
        decode: asyncio.Task[Response] | None = None
        leading: list[dict[str, Any]] = []
        if isinstance(early, dict) and early.get("streaming"):
            decode = asyncio.ensure_future(self._decode(path, body, early, headers, routed))
        elif first is not None:
            leading.append(first)  # a prefill instance without the early handle
        drain = asyncio.ensure_future(_read_to_end(events, leading))
        try:
            if decode is not None:
                legs: set[asyncio.Future[Any]] = {drain, decode}
                await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
                failure = None if drain.done() else decode.exception()
                if isinstance(failure, APIError) and failure.code == KV_TRANSFER_FAILED:
                    # The hold is gone: most often the prefill ended at its first token and
                    # dropped it, and its answer is on the way. Wait a little for it.
                    await asyncio.wait({drain}, timeout=HOLD_GONE_GRACE_S)
                if failure is not None and not drain.done():
                    # The decode leg failed while the prompt computes: stop the prefill too
                    # (its instance aborts the request and drops the hold).
                    await _settle(drain)
                    raise _as_retry(failure)
            end = await drain
        except BaseException:
            await _settle(drain, decode)
            raise
        await opened.aclose()  # read to its end: the prefill instance is done with it
        holds.saw(opened.instance_url, end.handle)
        if end.error is not None:
            await _settle(decode)
            error = _prefill_error(end.error)
            if error.status_code == 503:
                raise _Retry(error)
            raise error
        if not end.handed_off and end.finish_reason == "abort":
            # The decode instance gave up on the hand-off mid-prompt (draining, say): the
            # prefill instance ended the request without one.
            failure = decode.exception() if decode is not None and decode.done() and \
                not decode.cancelled() else None
            await _settle(decode)
            raise _as_retry(failure) if failure is not None else _Retry(APIError(
                503, "the decode instance gave up on the KV hand-off", code=KV_TRANSFER_FAILED))
        if not end.handed_off:
            await _settle(decode)
            return prefill_answer(end, endpoint, routed.stream, body, opened.instance_name)
        if decode is None:  # the handle came with the answer only
            assert end.handle is not None
            decode = asyncio.ensure_future(self._decode(path, body, end.handle, headers, routed))
        try:
            response = await decode
        except BaseException as error:
            await _settle(decode)
            raise _as_retry(error) from None
        response.headers[PREFILL_BACKEND_HEADER] = opened.instance_name
        return response

    async def _decode(self, path: str, body: dict[str, Any], handle: dict[str, Any],
                      headers: dict[str, str], routed: RoutedRequest) -> Response:
        decode_body = {**body, "kv_transfer_params": {**handle, "do_remote_prefill": True}}
        return await self._proxy.forward(path, json.dumps(decode_body).encode(), headers,
                                         dataclasses.replace(routed, request_class=DECODE_POOL))

    async def _try_unstreamed(self, path: str, endpoint: str, body: dict[str, Any],
                              headers: dict[str, str], routed: RoutedRequest,
                              holds: _Holds) -> Response:
        """The chain as it was before streamed prefill legs: the prefill instance answers
        whole, with the handle, and only then does the decode leg start."""
        prefill_body = {key: value for key, value in body.items() if key != "stream_options"}
        prefill_body.update(stream=False, kv_transfer_params={"do_remote_decode": True})
        prefill = await self._proxy.forward(path, json.dumps(prefill_body).encode(), headers,
                                            dataclasses.replace(routed, stream=False))
        prefill_backend = prefill.headers.get(BACKEND_HEADER, "")
        if prefill.status_code >= 400:
            return prefill
        answer = json.loads(bytes(prefill.body))
        handle = answer.pop("kv_transfer_params", None)
        if handle is None:  # finished at its first token
            return whole_answer(answer, endpoint, routed.stream, body, prefill_backend)
        if (instance := self._table.get(prefill_backend)) is not None:
            holds.saw(instance.spec.url, handle)
        try:
            response = await self._decode(path, body, handle, headers, routed)
        except APIError as error:
            raise _as_retry(error) from None
        response.headers[PREFILL_BACKEND_HEADER] = prefill_backend
        return response


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work``; if the client leaves first, cancel it (which closes both legs)."""
    task = asyncio.ensure_future(work)

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_left())
    racing: set[asyncio.Future[Any]] = {task, watcher}
    try:
        await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(watcher, task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return task.result()


async def _read_to_end(events: AsyncIterator[dict[str, Any]],
                       leading: list[dict[str, Any]]) -> PrefillEnd:
    end = PrefillEnd()
    for event in leading:
        end.add(event)
    if end.error is None:
        async for event in events:
            end.add(event)
            if end.error is not None:
                break
    return end


async def _settle(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel tasks and wait for them, even while this task is itself being cancelled; a
    decode leg that had already answered is closed (its instance aborts the request)."""
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    with anyio.CancelScope(shield=True):
        results = await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if isinstance(result, Response):
                await discard(result)


def _as_retry(error: BaseException | None) -> BaseException:
    """A decode leg's failure: a 503 (no decode instance took it, or its KV fetch failed)
    retries the chain; anything else is the client's answer."""
    if isinstance(error, APIError) and error.status_code == 503:
        return _Retry(error)
    return error if error is not None else RuntimeError("the decode leg ended without answer")


def _prefill_error(error: dict[str, Any]) -> APIError:
    code = error.get("code")
    status = 503 if code in _RETRY_CODES else 400 if code == INVALID_REQUEST else 500
    return APIError(status, str(error.get("message") or "the prefill instance failed"),
                    code=code if isinstance(code, str) else None,
                    param=error.get("param") if isinstance(error.get("param"), str) else None)


def _refuses_streamed_prefill(response: Response) -> bool:
    """A 400 on ``stream`` for ``kv_transfer_params``: an agent that answers prefill legs
    whole only."""
    if response.status_code != 400:
        return False
    try:
        error = json.loads(bytes(response.body)).get("error") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("param") == "stream" and \
        "kv_transfer_params" in str(error.get("message"))
