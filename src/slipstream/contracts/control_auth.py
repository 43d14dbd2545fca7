"""Credentials on the gRPC control port: a shared bearer token, checked on every call.

    operator (router) --metadata authorization: Bearer <token>--> :50051
        --ControlTokenCheck (a grpc.ServerInterceptor)--> Health / Stats / SetPool
        missing, repeated or wrong --> UNAUTHENTICATED, and the method never runs

Why a shared token from a Secret, not mTLS or a TokenReview (docs/tenancy.md): each
ServingReplica gets its own 256-bit token, derived by the operator from a master key only it
holds (``derive_control_token``), written into a Secret that the replica's agent pods mount.
It needs no certificate authority or rotation machinery (mTLS), and no API-server round trip
or ``tokenreviews`` RBAC on every agent (TokenReview), so a control call keeps working while
the API server is slow, and the agent stays usable outside Kubernetes. What it does not give
is encryption in transit: NetworkPolicies restrict who can reach the port, and clusters that
need the wire encrypted run a CNI or mesh that does it.

The token file is read again when it changes (a rotated Secret), at most once a second.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)
MIN_TOKEN_CHARS = 32
METADATA_KEY = "authorization"


def derive_control_token(master_key: bytes, namespace: str, replica: str) -> str:
    """The control token of one ServingReplica: HMAC-SHA256 of its namespace/name under the
    operator's master key, so the operator can always recompute it without reading the
    Secret it wrote (it holds no ``get`` on Secrets)."""
    return hmac.new(master_key, f"{namespace}/{replica}".encode(), hashlib.sha256).hexdigest()


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """What a client sends with every control call."""
    return () if token is None else ((METADATA_KEY, f"Bearer {token}"),)


class ControlToken:
    """The expected token, from a file that may be replaced while the agent runs."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._checked_s = float("-inf")
        self._token = b""
        self._refresh(force=True)
        if not self._token:
            raise ValueError(f"control token file {path} is unreadable or shorter than "
                             f"{MIN_TOKEN_CHARS} characters")

    def _refresh(self, force: bool = False) -> None:
        now_s = self._clock()
        if not force and now_s - self._checked_s < 1.0:
            return
        self._checked_s = now_s
        try:
            info = os.stat(self.path)
            stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
            if stamp == self._stamp:
                return
            token = self.path.read_text().strip().encode()
        except OSError as error:
            log.error("cannot read the control token file %s (%s); keeping the last token",
                      self.path, error)
            return
        if len(token) < MIN_TOKEN_CHARS:
            log.error("the control token in %s is shorter than %d characters; keeping the "
                      "last token", self.path, MIN_TOKEN_CHARS)
            return
        self._stamp, self._token = stamp, token

    def accepts(self, values: list[str]) -> bool:
        """Whether the call's ``authorization`` metadata is exactly one right bearer token."""
        with self._lock:
            self._refresh()
            expected = self._token
        if len(values) != 1:
            return False
        scheme, _, presented = values[0].strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode(), expected)


class ControlTokenCheck(grpc.ServerInterceptor):
    """Refuse every control call without the token, before the method runs."""

    def __init__(self, token: ControlToken) -> None:
        self._token = token
        self._deny = grpc.unary_unary_rpc_method_handler(_deny)

    def intercept_service(self, continuation, handler_call_details):
        values = [value for key, value in handler_call_details.invocation_metadata or ()
                  if key.lower() == METADATA_KEY and isinstance(value, str)]
        if self._token.accepts(values):
            return continuation(handler_call_details)
        return self._deny


def _deny(request: bytes, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "the control API needs 'authorization: Bearer <control token>'")
