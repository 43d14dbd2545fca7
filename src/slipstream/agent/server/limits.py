"""Limits on what one client can make the server do before its request is even validated.
Shared by ``slipstream serve`` and ``slipstream router``.

    connection --TimedH11Protocol: the request line and headers within
        request_read_timeout_s, else 408 and close
    --> read_body(): Content-Length over max_body_bytes -> 413 at once; the body itself
        within max_body_bytes (413) and request_read_timeout_s (408)
    --> parse_json(): malformed, nested too deeply, or strings with lone UTF-16 surrogates
        -> 400 in OpenAI's shape (never a 500 with an exception's text)

A refused body is never kept: reading stops at the limit, and the connection is closed
(``Connection: close``) so the rest of an oversized or half-sent body is not read either.
"""

from __future__ import annotations

import asyncio
import json
import re
from http import HTTPStatus
from typing import Any

import h11
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from slipstream.agent.server.config import DEFAULT_REQUEST_READ_TIMEOUT_S
from slipstream.contracts.errors import APIError, bad_request

# The defaults live in config.py: 4 MiB of body (a full 128k-token prompt as text or as token
# ids fits several times over), and 30 s for the request line, the headers and the body each,
# so a client that opens a connection and trickles a request (or sends nothing) is cut off,
# not waited for forever.
CLOSE = {"Connection": "close"}
# A JSON \u escape in the D800-DFFF range: the only way a lone surrogate gets into a parsed
# string (raw UTF-8 cannot hold one). Pairs match too; they are checked properly afterwards.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def body_too_large(limit: int) -> APIError:
    return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large", headers=CLOSE)


def read_timeout(timeout_s: float) -> APIError:
    return APIError(HTTPStatus.REQUEST_TIMEOUT,
                    f"The request was not received within {timeout_s:g} s.",
                    code="request_timeout", headers=CLOSE)


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, or ``APIError`` 413 (too large) or 408 (too slow)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("The Content-Length header is not a number.")
        if int(declared) > max_bytes:
            raise body_too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise body_too_large(max_bytes)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise read_timeout(timeout_s) from None
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """The body as JSON; every way it can be unusable is a 400 that says which."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as error:
        raise bad_request(f"We could not parse the JSON body of your request: {error}") from None
    except UnicodeDecodeError:
        raise bad_request("We could not parse the JSON body of your request: it is not valid "
                          "UTF-8.") from None
    except RecursionError:
        raise bad_request("We could not parse the JSON body of your request: it is nested "
                          "too deeply.") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise bad_request("We could not parse the JSON body of your request: a string holds a "
                          "lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair), "
                          "which is not text.")
    return data


def _has_lone_surrogate(data: Any) -> bool:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except RecursionError:  # parsed, but too deep to re-encode: refuse it as such
        raise bad_request("We could not parse the JSON body of your request: it is nested "
                          "too deeply.") from None
    return False


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's line and headers
    (uvicorn has none: a connection that sends half a request stays open forever). The body
    has its own deadline in ``read_body``."""

    request_read_timeout_s = DEFAULT_REQUEST_READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # the next request's headers are not all in
            if self._header_timer is None and not self.transport.is_closing():
                self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.request_read_timeout_s,
                                                  self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:  # nothing of ours in flight: say why we close
            # Written directly: h11 sends no response to a request it has not seen whole.
            body = json.dumps(read_timeout(self.request_read_timeout_s).body()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n"
                                 b"content-type: application/json\r\n"
                                 b"content-length: " + str(len(body)).encode() + b"\r\n"
                                 b"connection: close\r\n\r\n" + body)
        self.transport.close()


def timed_protocol(request_read_timeout_s: float) -> type[TimedH11Protocol]:
    """The protocol class to give uvicorn (``http=``) for this deadline."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"request_read_timeout_s": request_read_timeout_s})
