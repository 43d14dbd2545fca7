"""How a failed reconcile reaches kopf, so that kopf retries what may pass and stops on what
cannot.

    API conflict, throttling, 5xx, connection lost --> kopf.TemporaryError(delay): retried soon
    a spec no eligible node set can hold --> kopf.PermanentError (the Placed condition and a
        Warning Event, written by reconcile, say why); only a spec change or new nodes help,
        and the resync timer keeps looking for the latter
    anything else --> raised as is (kopf's own backoff): a bug, not an expected state
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import kopf
import urllib3
from kubernetes.client.rest import ApiException

from slipstream.operator.placement import PlacementFailure

CONFLICT_RETRY_S = 1.0  # someone else wrote the object: read it again at once
BUSY_RETRY_S = 5.0  # the API server is throttling or failing: give it a moment
TRANSIENT_STATUSES = {409: CONFLICT_RETRY_S, 429: BUSY_RETRY_S, 500: BUSY_RETRY_S,
                      502: BUSY_RETRY_S, 503: BUSY_RETRY_S, 504: BUSY_RETRY_S}


def transient_delay_s(error: BaseException) -> float | None:
    """Seconds to wait before retrying after ``error``; None when retrying cannot help."""
    if isinstance(error, ApiException):
        delay = TRANSIENT_STATUSES.get(error.status or 0)
        retry_after = (error.headers or {}).get("Retry-After") if delay else None
        if retry_after is not None and retry_after.isdigit():
            return float(retry_after)
        return delay
    if isinstance(error, urllib3.exceptions.HTTPError):  # connection refused, reset, timeout
        return BUSY_RETRY_S
    return None


def describe(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return f"HTTP {error.status} {error.reason}"
    return str(error) or type(error).__name__


@contextmanager
def temporary_api_errors(what: str) -> Iterator[None]:
    """Re-raise transient API failures inside the block as ``kopf.TemporaryError``."""
    try:
        yield
    except (ApiException, urllib3.exceptions.HTTPError) as error:
        delay = transient_delay_s(error)
        if delay is None:
            raise
        raise kopf.TemporaryError(f"{what}: {describe(error)}; retrying in {delay:g} s",
                                  delay=delay) from error


def raise_if_unplaceable(failure: PlacementFailure | None) -> None:
    if failure is not None and failure.permanent:
        raise kopf.PermanentError(f"{failure.reason}: {failure.message}")
