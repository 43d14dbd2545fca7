"""Reading an instance's answer as it streams through the router: server-sent events scanned
without decoding the stream, whether an event is a first token, an error or the end, and the
usage a whole body reports."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httpx

from slipstream.agent.router.dispatcher import Lease
from slipstream.contracts.errors import APIError


class EventStream:
    """An instance's SSE stream read by the router itself, as JSON objects (``[DONE]`` and
    lines that are not JSON objects are skipped). ``aclose`` ends it: the instance aborts a
    request still running, and the lease is released."""

    def __init__(self, upstream: httpx.Response, lease: Lease,
                 count: Callable[[str], None]) -> None:
        self.upstream = upstream
        self.lease = lease
        self.instance_name = lease.instance.name
        self.instance_url = lease.instance.spec.url
        self._count = count
        self._outcome = "cancelled"

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """The events in order; an instance lost mid-stream raises ``APIError`` (502)."""
        buffer = b""
        try:
            async for chunk in self.upstream.aiter_bytes():
                buffer += chunk
                while (end := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:end], buffer[end + 2:]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            if self._outcome != "error":
                                self._outcome = "ok"
                            continue
                        try:
                            data = json.loads(payload)
                        except (json.JSONDecodeError, UnicodeDecodeError):
                            continue
                        if isinstance(data, dict):
                            if "error" in data:
                                self._outcome = "error"
                            elif _event_state(payload) == "token":
                                self.lease.first_token()  # the instance is past the prompt
                            yield data
        except httpx.TransportError as error:
            self._outcome = "error"
            raise APIError(502, f"the instance serving this request failed mid-stream "
                                f"({type(error).__name__})", code="instance_failed") from None

    async def aclose(self) -> None:
        if self.lease.finished:
            return
        await self.upstream.aclose()
        self.lease.finish()
        self._count(self._outcome)


def scan_events(buffer: bytearray, start: int) -> tuple[str, int]:
    """Look at complete SSE events from ``start``: ``token`` once one carries output (or the
    stream's end), ``error`` for an error event, else ``none``; and where scanning stopped."""
    while True:
        end = buffer.find(b"\n\n", start)
        if end < 0:
            return "none", start
        event, start = bytes(buffer[start:end]), end + 2
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return "token", start
            state = _event_state(payload)
            if state != "none":
                return state, start


def _event_state(payload: bytes) -> str:
    try:
        data = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "none"
    if not isinstance(data, dict):
        return "none"
    if "error" in data:
        return "error"
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("finish_reason"):
            return "token"
    return "token" if data.get("usage") else "none"


def usage_completion_tokens(content: bytes) -> int | None:
    try:
        tokens = json.loads(content)["usage"]["completion_tokens"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return tokens if isinstance(tokens, int) else None


def is_openai_error(content: bytes) -> bool:
    try:
        error = json.loads(content).get("error")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def printable(content: bytes, limit: int = 200) -> str:
    text = content[:limit].decode(errors="replace")
    return "".join(ch if ch.isprintable() else " " for ch in text).strip() or "(no body)"
