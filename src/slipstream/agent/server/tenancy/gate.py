"""The tenancy gate: ASGI middleware in front of the agent's and the router's API.

    request --/v1/*?--> headers past MAX_HEADER_BYTES --> 431
                    --> credentials in the URL?      --> 400 (never served, never logged)
                    --> Authorization: Bearer <key>  --> Tenants.identify --> 401 / 403
                    --> POST completions / chat      --> TenantLimiter.admit --> 429
                    --> the app, with the Caller in the scope (identity.caller_of)
                        response start: + x-slipstream-slo-class / -clamped, x-ratelimit-*
                        response end (or the client gone): in-flight slot released,
                        outcome counted under the tenant's bounded label

It runs before the body is read, so an unauthenticated or over-limit client costs a header
parse, and nothing of its request reaches the tokenizer or the engine. ``/health`` and
``/metrics`` (kubelet, Prometheus) are not gated; NetworkPolicies keep them in the cluster.
Without a tenants file (``tenants=None``) it only counts outcomes, under the label "open".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slipstream.contracts.errors import APIError, bad_request, error_response
from slipstream.agent.server.tenancy.identity import CALLER_SCOPE_KEY, Caller
from slipstream.agent.server.tenancy.keys import KeyProblem, bearer_token, credential_in_query
from slipstream.agent.server.tenancy.registry import (
    NONE_LABEL, OPEN_LABEL, Tenants, unauthorized)
from slipstream.agent.server.tenancy.slo_policy import CLAMPED_HEADER, CLASS_HEADER

GATED_PREFIX = "/v1/"
# The HTTP server (uvicorn with httptools) accepts header blocks of any size; no API client
# sends more than a few KiB, and a large block only costs memory before anything is checked.
MAX_HEADER_BYTES = 32 * 1024
LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Outcome label values of the tenant request counters.
OUTCOMES = ("ok", "unauthenticated", "forbidden", "rate_limited", "rejected", "error")
OutcomeCounter = Callable[[str, str], None]  # (tenant label, outcome)


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    return {401: "unauthenticated", 403: "forbidden", 429: "rate_limited"}.get(
        status, "rejected" if status < 500 else "error")


class TenancyGate:
    def __init__(self, app: Any, tenants: Tenants | None, count: OutcomeCounter | None = None,
                 on_clamped: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.tenants = tenants
        self._count = count or (lambda label, outcome: None)
        self._on_clamped = on_clamped or (lambda label: None)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATED_PREFIX):
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))
        if header_bytes > MAX_HEADER_BYTES:
            self._count(NONE_LABEL, "rejected")
            await error_response(APIError(
                431, f"Request header fields too large: {header_bytes} bytes, at most "
                     f"{MAX_HEADER_BYTES}.", code="request_header_fields_too_large",
                headers={"Connection": "close"}))(scope, receive, send)
            return
        if self.tenants is None:
            await self._open(scope, receive, send)
            return
        limited = scope["method"] == "POST" and scope["path"] in LIMITED_PATHS
        caller: Caller | None = None
        try:
            caller = self._identify(scope)
            if limited:
                caller.limiter.admit()
        except APIError as error:
            self._count(caller.label if caller is not None else NONE_LABEL,
                        outcome_of(int(error.status_code)))
            await error_response(error)(scope, receive, send)
            return
        scope[CALLER_SCOPE_KEY] = caller
        status = 500

        async def send_with_headers(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  *_caller_headers(caller)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            if limited:
                caller.limiter.release()
            self._count(caller.label, outcome_of(status))
            if caller.slo is not None and caller.slo.clamped:
                self._on_clamped(caller.label)

    async def _open(self, scope: dict, receive: Any, send: Any) -> None:
        status = 500

        async def send_counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self._count(OPEN_LABEL, outcome_of(status))

    def _identify(self, scope: dict) -> Caller:
        in_query = credential_in_query(scope.get("query_string", b""))
        if in_query is not None:
            raise bad_request(f"Credentials in the URL ({in_query}=...) are refused: URLs end up "
                              "in logs. Send the key as 'Authorization: Bearer YOUR_KEY'.",
                              param=in_query)
        try:
            key = bearer_token(scope.get("headers", []))
        except KeyProblem as problem:
            raise unauthorized(str(problem), missing=problem.missing) from None
        assert self.tenants is not None
        return self.tenants.identify(key)


def _caller_headers(caller: Caller) -> list[tuple[bytes, bytes]]:
    headers = []
    if caller.slo is not None:
        headers.append((CLASS_HEADER.encode(), caller.slo.class_name.encode()))
        if caller.slo.clamped:
            headers.append((CLAMPED_HEADER.encode(), "; ".join(caller.slo.clamped).encode()))
    limit = caller.tenant.limits.requests_per_minute
    remaining = caller.limiter.remaining_requests()
    if limit is not None and remaining is not None:
        headers += [(b"x-ratelimit-limit-requests", str(limit).encode()),
                    (b"x-ratelimit-remaining-requests", str(remaining).encode())]
    return headers
