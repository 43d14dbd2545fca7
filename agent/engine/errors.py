"""Errors after which an engine cannot go on serving.

A failed step (a bad request's corner case, say) fails the requests in flight and the engine
keeps serving. An ``EngineDeadError`` is different: part of the engine is gone (a worker
process died), its state cannot be trusted, and the only recovery is a restart of the whole
instance. The async engine then fails every request with "unavailable" and stops, so the
server can exit non-zero and its supervisor (Kubernetes) restarts it.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine lost a part it cannot run without."""
