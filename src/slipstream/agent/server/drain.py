"""Graceful shutdown: SIGTERM (or Ctrl-C) drains the instance instead of cutting it off.

Kubernetes sends SIGTERM on every rollout, scale-down and rebalance, then waits the pod's
``terminationGracePeriodSeconds`` before SIGKILL. On the first signal ``DrainingServer``:

    1. tells the engine to drain: /health answers 503 (the pod goes not-ready) and a new
       request gets a 503 ``draining``, which the router retries on another instance;
    2. stops accepting connections (uvicorn's own shutdown) while the requests in flight run
       on, streams included;
    3. when ``drain_timeout_s`` runs out, ends every request still running with a ``drained``
       error: a stream gets an error event and ``[DONE]``, a non-streaming request a 503;
    4. shuts the engine down and returns, so ``slipstream serve`` exits 0.

A second Ctrl-C forces the exit at once. Unlike plain uvicorn it does not re-raise the signal
after a clean shutdown (that made the process exit 143 for a drain that went right).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from slipstream.agent.server.limits import timed_protocol

if TYPE_CHECKING:
    from slipstream.agent.engine.engine_client import ServingEngine

log = logging.getLogger(__name__)

# After the drain period, time for the cut requests' last events to reach their clients before
# uvicorn cancels what is left.
DRAIN_FLUSH_S = 5.0
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: ServingEngine, drain_timeout_s: float
                 ) -> None:
        super().__init__(config)
        self._engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_started: Callable[[], None] | None = None
        self.on_drain: Callable[[], None] | None = None  # passes the drain on (api_processes)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()  # the port listens and the app (warm-up included) is up

    def begin_drain(self) -> None:
        """Start the drain (from a signal handler or any thread); idempotent."""
        if self.draining:
            return
        self.draining = True
        in_flight = self._engine.num_in_flight
        log.info("draining: no new requests; %d in flight get up to %.0f s to finish",
                 in_flight, self.drain_timeout_s)
        self._engine.drain()
        if self.on_drain is not None:
            self.on_drain()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, self.drain_timeout_s,
                                            self._drain_deadline)
        self.should_exit = True

    def _drain_deadline(self) -> None:
        left = self._engine.num_in_flight
        if left:
            log.warning("drain period of %.0f s is over: ending %d request(s) still running",
                        self.drain_timeout_s, left)
        self._engine.cut_in_flight()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
            return
        self.begin_drain()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def reserve_port(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """Bind ``host:port`` now, before the model loads, so that a port in use fails at once
    (OSError) rather than minutes later. The socket does not listen yet: until uvicorn
    starts serving on it (``DrainingServer.run(sockets=[...])``), a connection is refused,
    not left waiting, so nobody mistakes a loading server for a ready one. ``shared``: with
    SO_REUSEPORT, for the other API processes of ``--api-processes`` to bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets
    # whose proto says TCP. With proto 0 every streamed event after the response headers on
    # a reused keep-alive connection waited for the client's delayed ACK: ~40 ms more TTFT.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def server_config(app: Any, *, host: str, port: int, log_level: str, keepalive_s: int,
                  drain_timeout_s: float, request_read_timeout_s: float) -> uvicorn.Config:
    """uvicorn's settings for a draining server: its own graceful-shutdown timeout is only a
    backstop, after the drain deadline has ended every request. Request headers must arrive
    within ``request_read_timeout_s`` (limits.py)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          access_log=log_level == "debug", timeout_keep_alive=keepalive_s,
                          timeout_graceful_shutdown=int(drain_timeout_s + DRAIN_FLUSH_S) + 1,
                          http=timed_protocol(request_read_timeout_s))
