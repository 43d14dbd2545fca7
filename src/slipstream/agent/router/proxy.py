"""Forwarding one request to an instance: retry only what a retry can fix, then passthrough.

    RoutedRequest + original body --Dispatcher.acquire--> Lease(instance)
        --POST instance/v1/...--> for a stream, hold the SSE prefix until the first token
            no connection (refused, connect timeout), or a 503 (the instance is draining,
            starting or saturated): the request never ran there; mark the instance, try
            another (up to max_attempts), keeping the fairness tag
            anything else (4xx, 500, a connection lost mid-request, an error event): answered
            as it is; the request is never sent to a second instance
            first token seen: send the held prefix, then every upstream chunk as it arrives

Why so strict: a request that made one instance fail (a 500, a dropped connection) may do
the same to the next one; retrying it is how one bad request takes down a whole pool. A
refused connection or a 503 says the request was never run, so trying elsewhere is safe.

Before the first token the client has seen nothing that it would see twice: the agent's
streams open with a role-only chunk that carries no token, and that chunk is held back with
the rest of the prefix. After it, bytes are forwarded as they come, never re-framed. Every
error the router itself produces is in OpenAI's JSON shape (an SSE error event once a
stream has started), and an instance's non-JSON error body is wrapped into that shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi.responses import Response, StreamingResponse

from slipstream.agent.engine.errors import KV_TRANSFER_FAILED
from slipstream.agent.router.classify import RoutedRequest
from slipstream.agent.router.config import RouterConfig
from slipstream.agent.router.dispatcher import Dispatcher, Lease, NoInstanceError
from slipstream.agent.router.metrics import RouterMetrics
from slipstream.contracts.errors import APIError
from slipstream.agent.router.upstream_events import (EventStream, is_openai_error, printable,
                                                     scan_events, usage_completion_tokens)

log = logging.getLogger(__name__)
BACKEND_HEADER = "x-slipstream-backend"
FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE_EVENT = b"data: [DONE]"
T = TypeVar("T")


class RetryableFailure(Exception):
    """The request never ran on the instance (no connection, or a 503); another may serve
    it. The instance gets no traffic for the cooldown: it is down, draining or saturated;
    unless ``instance_ok`` (a decode instance that could not fetch the request's KV from
    its prefill instance, which says nothing about the decode instance itself)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code  # the instance's error code, if it said one
        self.instance_ok = code == KV_TRANSFER_FAILED


class Proxy:
    def __init__(self, config: RouterConfig, dispatcher: Dispatcher, client: httpx.AsyncClient,
                 metrics: RouterMetrics) -> None:
        self._config = config
        self._dispatcher = dispatcher
        self._client = client
        self._metrics = metrics

    @property
    def client(self) -> httpx.AsyncClient:
        """The one upstream client (the disaggregated chain's hold releases use it too)."""
        return self._client

    async def forward(self, path: str, body: bytes, headers: dict[str, str],
                      routed: RoutedRequest) -> Response:
        return await self._placed(routed, lambda lease: self._attempt(
            path, body, headers, routed, lease))

    async def open_stream(self, path: str, body: bytes, headers: dict[str, str],
                          routed: RoutedRequest) -> EventStream | Response:
        """Send a streaming request that the router reads itself, event by event (the
        prefill leg of a disaggregated chain), placed and retried as ``forward`` does. An
        instance's HTTP error comes back as a ``Response``, as from ``forward``."""
        return await self._placed(routed, lambda lease: self._open(
            path, body, headers, routed, lease))

    async def _placed(self, routed: RoutedRequest,
                      attempt_on: Callable[[Lease], Awaitable[T]]) -> T:
        finish_tag = self._dispatcher.tag(routed)
        tried: set[str] = set()
        last_failure = "no instance answered"
        # A decode leg refused because its KV could not be fetched keeps that code: the
        # disaggregated chain tells it from a decode pool with no room.
        code = "no_instance_available"
        for attempt in range(self._config.max_attempts):
            try:
                lease = await self._dispatcher.acquire(routed, finish_tag, frozenset(tried))
            except NoInstanceError as error:
                self._count(routed, routed.request_class, "rejected")
                message = str(error) if attempt == 0 else f"{error}; last failure: {last_failure}"
                raise APIError(503, message, code=code) from None
            tried.add(lease.instance.name)
            if attempt > 0:
                self._metrics.retries.labels(lease.instance.pool).inc()
            try:
                return await attempt_on(lease)
            except RetryableFailure as failure:
                last_failure = f"{lease.instance.name}: {failure}"
                code = KV_TRANSFER_FAILED if failure.code == KV_TRANSFER_FAILED \
                    else "no_instance_available"
                log.warning("attempt %d on %s was refused, trying another instance: %s",
                            attempt + 1, lease.instance.name, failure)
                if not failure.instance_ok:
                    lease.instance.mark_failed(time.monotonic(),
                                               self._config.unhealthy_cooldown_s)
                lease.finish()
            except BaseException:  # the client went away, or a bug: free the slot
                lease.finish()
                raise
        self._count(routed, routed.request_class, "error")
        raise APIError(503, f"{self._config.max_attempts} instances refused the request; last: "
                            f"{last_failure}", code=code)

    async def _send(self, path: str, body: bytes, headers: dict[str, str],
                    routed: RoutedRequest, lease: Lease) -> httpx.Response:
        """POST to the leased instance, streamed; a refusal (503) or a lost connection
        raises the failure the retry loop reads."""
        request = self._client.build_request("POST", f"{lease.instance.spec.url}{path}",
                                             content=body, headers=headers)
        try:
            upstream = await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise RetryableFailure(f"no connection: {type(error).__name__}") from None
        except httpx.TransportError as error:
            # Sent, then lost: the instance may have failed because of this very request.
            self._finish_failed(routed, lease, error)
            raise instance_lost(error) from None
        if upstream.status_code == 503:
            raise await _refused(upstream)
        return upstream

    async def _attempt(self, path: str, body: bytes, headers: dict[str, str],
                       routed: RoutedRequest, lease: Lease) -> Response:
        upstream = await self._send(path, body, headers, routed, lease)
        if upstream.status_code >= 400 or not routed.stream:
            return await self._whole_body(upstream, routed, lease)
        # One iterator for the whole stream: the prefix is read from it, the rest follows.
        chunks = upstream.aiter_bytes()
        try:
            held = await self._hold_until_first_token(upstream, chunks)
        except APIError as error:
            self._finish_failed(routed, lease, error)
            raise
        lease.first_token()
        self._observe_ttft(routed, lease)

        async def close() -> None:  # also when the client left before the body started
            await upstream.aclose()
            if not lease.finished:
                lease.finish()
                self._count(routed, lease.instance.pool, "cancelled")

        return _PassThroughResponse(self._pass_through(held, chunks, upstream, routed, lease),
                                    close,
                                    status_code=upstream.status_code,
                                    media_type="text/event-stream",
                                    headers={**SSE_HEADERS, BACKEND_HEADER: lease.instance.name})

    async def _open(self, path: str, body: bytes, headers: dict[str, str],
                    routed: RoutedRequest, lease: Lease) -> EventStream | Response:
        upstream = await self._send(path, body, headers, routed, lease)
        if upstream.status_code >= 400:
            return await self._whole_body(upstream, routed, lease)
        return EventStream(upstream, lease, lambda outcome: self._count(
            routed, lease.instance.pool, outcome))

    async def _whole_body(self, upstream: httpx.Response, routed: RoutedRequest,
                          lease: Lease) -> Response:
        try:
            content = await upstream.aread()
        except httpx.TransportError as error:
            self._finish_failed(routed, lease, error)
            raise instance_lost(error) from None
        finally:
            await upstream.aclose()
        ok = upstream.status_code < 400
        output_tokens = usage_completion_tokens(content) if ok else None
        if ok:
            lease.first_token()
            self._observe_ttft(routed, lease)
        lease.finish(output_tokens)
        self._count(routed, lease.instance.pool, "ok" if ok else "error")
        headers = {BACKEND_HEADER: lease.instance.name}
        if not ok and not is_openai_error(content):
            body = APIError(upstream.status_code, f"the instance answered HTTP "
                            f"{upstream.status_code}: {printable(content)}",
                            code="instance_error").body()
            return Response(json.dumps(body), status_code=upstream.status_code,
                            media_type="application/json", headers=headers)
        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"),
                        headers=headers)

    def _finish_failed(self, routed: RoutedRequest, lease: Lease,
                       error: Exception | None = None) -> None:
        if error is not None:
            log.warning("%s lost a request it was serving (%r, from %r); not retrying it",
                        lease.instance.name, error, error.__cause__)
        lease.finish()
        self._count(routed, lease.instance.pool, "error")

    async def _hold_until_first_token(self, upstream: httpx.Response,
                                      chunks: AsyncIterator[bytes]) -> bytes:
        """The stream's prefix up to its first token, an error event or its end; a
        connection lost before that is answered as a 502, not retried."""
        held = bytearray()
        scanned = 0
        try:
            async for chunk in chunks:
                held += chunk
                state, scanned = scan_events(held, scanned)
                if state != "none":
                    break
        except httpx.TransportError as error:
            await upstream.aclose()
            raise instance_lost(error) from None
        except BaseException:
            await upstream.aclose()
            raise
        return bytes(held)

    async def _pass_through(self, held: bytes, chunks: AsyncIterator[bytes],
                            upstream: httpx.Response, routed: RoutedRequest,
                            lease: Lease) -> AsyncIterator[bytes]:
        events = held.count(b"data: ")
        outcome = "error"
        # The clients that stop reading at [DONE] (the openai client closes the connection
        # there) may be seen leaving before the upstream body's end is read: such a stream
        # was served whole, so it counts as ok, not cancelled.
        tail = held[-len(_DONE_EVENT):]
        done = _DONE_EVENT in held
        try:
            yield held
            async for chunk in chunks:
                events += chunk.count(b"data: ")
                done = done or _DONE_EVENT in tail + chunk
                tail = (tail + chunk)[-len(_DONE_EVENT):]
                yield chunk
            outcome = "ok"
        except httpx.TransportError as error:
            log.warning("stream from %s broke after the first token: %s", lease.instance.name,
                        error)
            failure = APIError(502, f"the instance serving this request failed mid-stream "
                                    f"({type(error).__name__})", code="instance_failed")
            yield b"data: " + json.dumps(failure.body()).encode() + b"\n\n"
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "ok" if done else "cancelled"  # the client went away
            raise
        finally:
            await upstream.aclose()
            # Events approximate tokens (one delta per engine step): the role chunk and
            # [DONE] are not tokens.
            lease.finish(max(0, events - 2) if outcome == "ok" else None)
            self._count(routed, lease.instance.pool, outcome)

    def _observe_ttft(self, routed: RoutedRequest, lease: Lease) -> None:
        self._metrics.ttft_s.labels(routed.request_class, lease.instance.pool).observe(
            time.monotonic() - routed.arrival_s)

    def _count(self, routed: RoutedRequest, pool: str, outcome: str) -> None:
        self._metrics.requests.labels(routed.request_class, pool, outcome).inc()


class _PassThroughResponse(StreamingResponse):
    """A streaming response that always runs ``on_close``, even if its body never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()

    async def discard(self) -> None:
        """Never send it: close the upstream stream (the instance aborts the request)."""
        await self._on_close()


async def discard(response: Response) -> None:
    """Drop a response that will not be sent; a held upstream stream is closed."""
    if isinstance(response, _PassThroughResponse):
        await response.discard()


def forwarded_headers(headers: Any) -> dict[str, str]:
    return {name: headers[name] for name in FORWARDED_REQUEST_HEADERS if name in headers}


def instance_lost(error: httpx.TransportError) -> APIError:
    return APIError(502, f"the instance serving this request failed before answering "
                         f"({type(error).__name__}); it was not retried elsewhere",
                    code="instance_failed")


async def _refused(upstream: httpx.Response) -> RetryableFailure:
    """A 503: the request never ran there."""
    text = await _read_quietly(upstream)
    try:
        code = json.loads(text)["error"]["code"]
    except (json.JSONDecodeError, KeyError, TypeError):
        code = None
    return RetryableFailure(f"HTTP 503: {text[:200]}", code if isinstance(code, str) else None)


async def _read_quietly(upstream: httpx.Response) -> str:
    try:
        return (await upstream.aread()).decode(errors="replace")
    except httpx.TransportError:
        return ""
    finally:
        await upstream.aclose()

