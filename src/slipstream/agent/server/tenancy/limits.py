"""Per-tenant rate limits: requests and tokens per minute, and requests in flight.

    gate.py: a request arrives --TenantLimiter.admit()--> in flight +1, one request taken
                                                         (or 429, nothing taken)
    handler: prompt tokens known --charge_tokens(prompt + max_tokens)--> taken (or 429)
    response finished (streamed to its end, or the client left) --release()--> in flight -1

Each per-minute limit is a token bucket that holds one minute's worth and refills
continuously, so a tenant may burst up to its minute's allowance and then goes at the
limit's rate. A tokens-per-minute charge is the prompt plus ``max_tokens`` (the most the
request may generate), reserved at admission as OpenAI does; a request larger than a whole
minute's allowance is admitted once the bucket is full and leaves it in debt. A refusal is
OpenAI's: HTTP 429, ``code: rate_limit_exceeded``, ``type`` ``requests`` or ``tokens``, and
``Retry-After`` in whole seconds.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from slipstream.contracts.errors import APIError
from slipstream.agent.server.tenancy.config import Limits

RATE_LIMITED = "rate_limit_exceeded"


class TokenBucket:
    def __init__(self, per_minute: int, now_s: float) -> None:
        self.capacity = float(per_minute)
        self.rate_per_s = per_minute / 60.0
        self.level = self.capacity
        self._updated_s = now_s

    def _refill(self, now_s: float) -> None:
        self.level = min(self.capacity, self.level + (now_s - self._updated_s) * self.rate_per_s)
        self._updated_s = now_s

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until ``amount`` (at most a full bucket) may be taken; 0 if it may now."""
        self._refill(now_s)
        needed = min(amount, self.capacity)
        return 0.0 if self.level >= needed else (needed - self.level) / self.rate_per_s

    def take(self, amount: float) -> None:
        self.level -= amount  # may go below 0: a large request leaves the bucket in debt


def rate_limited(what: str, limit: str, wait_s: float) -> APIError:
    retry_after = max(1, math.ceil(wait_s))
    return APIError(429, f"Rate limit reached for {what} ({limit}). Please try again in "
                         f"{retry_after}s.", code=RATE_LIMITED,
                    error_type="tokens" if "tokens" in what else "requests",
                    headers={"Retry-After": str(retry_after)})


class TenantLimiter:
    """One tenant's limits and usage. Thread-safe: the router and agent call it from their
    event loop, tests and benchmarks from wherever."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.in_flight = 0
        self.limits = limits
        self._requests: TokenBucket | None = None
        self._tokens: TokenBucket | None = None
        self.update(limits)

    def update(self, limits: Limits) -> None:
        """New limits from a reloaded file; usage so far carries over."""
        now_s = self._clock()
        with self._lock:
            self.limits = limits
            self._requests = _rebucket(self._requests, limits.requests_per_minute, now_s)
            self._tokens = _rebucket(self._tokens, limits.tokens_per_minute, now_s)

    def admit(self) -> None:
        """Take one request and one in-flight slot, or raise the 429 (taking nothing)."""
        now_s = self._clock()
        with self._lock:
            cap = self.limits.max_in_flight
            if cap is not None and self.in_flight >= cap:
                raise rate_limited("requests in flight", f"limit {cap} at once", 1.0)
            if self._requests is not None:
                wait_s = self._requests.wait_s(1, now_s)
                if wait_s > 0:
                    raise rate_limited("requests per min (RPM)",
                                       f"limit {self.limits.requests_per_minute}", wait_s)
                self._requests.take(1)
            self.in_flight += 1

    def release(self) -> None:
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)

    def charge_tokens(self, amount: int) -> None:
        """Reserve ``amount`` tokens, or raise the 429."""
        if self._tokens is None:
            return
        now_s = self._clock()
        with self._lock:
            wait_s = self._tokens.wait_s(amount, now_s)
            if wait_s > 0:
                raise rate_limited("tokens per min (TPM)",
                                   f"limit {self.limits.tokens_per_minute}, requested {amount}",
                                   wait_s)
            self._tokens.take(amount)

    def remaining_requests(self) -> int | None:
        if self._requests is None:
            return None
        with self._lock:
            self._requests.wait_s(0, self._clock())
            return max(0, math.floor(self._requests.level))


def _rebucket(bucket: TokenBucket | None, per_minute: int | None,
              now_s: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    fresh = TokenBucket(per_minute, now_s)
    if bucket is not None:
        bucket.wait_s(0, now_s)
        fresh.level = min(fresh.capacity, bucket.level)
    return fresh
