"""Errors after which an engine cannot go on serving.

A failed step (a bad request's corner case, say) fails the requests in flight and the engine
keeps serving. An ``EngineDeadError`` is different: part of the engine is gone (a worker
process died), its state cannot be trusted, and the only recovery is a restart of the whole
instance. The async engine then fails every request with "unavailable" and stops, so the
server can exit non-zero and its supervisor (Kubernetes) restarts it.
"""

from __future__ import annotations

# Why a request ended with an error (``RequestOutput.error_code``). The server maps each to
# an HTTP status; only the ones a retry elsewhere can fix are 503s (see server/generation.py).
INVALID_REQUEST = "invalid_request"  # the engine refused the request (the message says why)
REQUEST_FAILED = "request_failed"  # this request made the step fail; the others went on
ENGINE_ERROR = "engine_error"  # a step failed for a reason no single request explains
ENGINE_DEAD = "engine_dead"  # a worker died while the request was in flight
DRAINED = "drained"  # the instance is shutting down and its drain period ran out
SHUTTING_DOWN = "shutting_down"  # the engine stopped before the request could start
KV_TRANSFER_FAILED = "kv_transfer_failed"  # decode role: the prompt's KV could not be fetched


class KVTierLoadError(RuntimeError):
    """Loading KV from the host tier onto the device failed part-way: these device blocks
    do not hold what their hashes say. The engine drops their hashes and recomputes the
    requests that hold them (a failing tier never fails a request, nor serves bad KV)."""

    def __init__(self, device_blocks: tuple[int, ...], cause: Exception) -> None:
        super().__init__(f"loading {len(device_blocks)} KV blocks from the host tier failed: "
                         f"{type(cause).__name__}: {cause}")
        self.device_blocks = device_blocks


class EngineUnavailable(RuntimeError):
    """The engine takes no new requests now: not started yet, draining, or dead. The request
    never ran, so another instance may serve it."""


class EngineDeadError(EngineUnavailable):
    """The engine lost a part it cannot run without."""
