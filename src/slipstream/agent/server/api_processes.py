"""More API processes on one engine core: ``slipstream serve --api-processes N``.

    first API process (cli.run)                                 engine-core process
      engine core client, warm-up, gRPC control API                scheduler, KV, model
      once serving: spawns API processes 1..N-1 --Attach(k)-->   also pulls k's commands,
      (each: EngineCoreClient(attach=...), its own uvicorn)        pushes k's outputs to k
    every API process listens on the same port (SO_REUSEPORT): the kernel spreads the
    connections over them

Each process tokenizes, detokenizes, checks stop strings and writes SSE for the requests it
accepted, so that work spreads over N CPUs instead of one. The core sends each process its
own requests' outputs, and all of them the same stats and step summaries.

Metrics: request-level series are merged across the processes at every scrape
(prometheus_client's multiprocess mode, ``metrics.merge_across_processes``); engine-level ones
are the same in every process. Control: the gRPC control API runs in the first process, which
passes pool moves on. Lifetime: SIGTERM reaches the first process (PID 1 of the pod), which
passes it on, so every process drains; the first process waits for the others before it
stops the core. When the core dies the first process tells the others (each fails its
requests with ``engine_dead`` and exits 3); when another API process dies, the first treats
it like a dead core. The others die with the first (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import threading
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.server.config import ServerConfig

if TYPE_CHECKING:
    from slipstream.agent.server.engine_core import EngineCoreClient
    from slipstream.agent.server.metrics import ServingMetrics

log = logging.getLogger(__name__)

EXIT_GRACE_S = 10.0  # after the drain period, for the other processes to exit


class ClientAddress(NamedTuple):
    """Where API process ``client`` (1..N-1) binds: its commands to the core, and the core's
    outputs (and the first process's relays) to it."""

    client: int
    command_addr: str
    output_addr: str

    @classmethod
    def in_dir(cls, directory: Path, client: int) -> ClientAddress:
        return cls(client, f"ipc://{directory}/commands-{client}",
                   f"ipc://{directory}/outputs-{client}")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, as every API process's is."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio disables Nagle on accepted sockets only then (drain.reserve_port)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class PoolEverywhere:
    """The first process's pool holder for the control API: its own metrics, and a relay to
    the other API processes, so every process labels new requests with the new pool."""

    def __init__(self, metrics: ServingMetrics, engine: EngineCoreClient) -> None:
        self._metrics = metrics
        self._engine = engine

    @property
    def pool(self) -> str:
        return self._metrics.pool

    def set_pool(self, pool: str) -> None:
        self._metrics.set_pool(pool)
        self._engine.relay_pool(pool)


class ApiProcesses:
    """The API processes after the first: started once the first one serves, told to drain
    with it, waited for before the core stops."""

    def __init__(self, count: int, engine: EngineCoreClient, engine_config: EngineConfig,
                 directory: Path) -> None:
        self.count = count  # the others, N - 1
        self._engine = engine
        self._engine_config = engine_config
        self._directory = directory
        self._processes: list[BaseProcess] = []
        self._stopping = threading.Event()

    def start(self, port: int, server_config: ServerConfig) -> None:
        """Spawn them (each binds ``port`` itself) and attach each to the engine core."""
        context = multiprocessing.get_context("spawn")
        for client in range(1, self.count + 1):
            address = ClientAddress.in_dir(self._directory, client)
            process = context.Process(
                target=run_api_process, name=f"slipstream-api-{client}",
                args=(address, self._engine_config, server_config, port))
            process.start()
            self._processes.append(process)
            self._engine.attach_api_process(client, address)
        threading.Thread(target=self._watch, name="slipstream-api-processes",
                         daemon=True).start()
        log.info("%d more API processes serve port %d", self.count, port)

    def _watch(self) -> None:
        """An API process that exits on its own (not drained by us) ends the server: its
        requests cannot be answered any more, and the core would run them for nobody."""
        sentinels = {process.sentinel: process for process in self._processes}
        while not self._stopping.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            for sentinel in ready:
                process = sentinels.pop(cast(int, sentinel))
                if not self._stopping.is_set():
                    self._engine.fail(f"API process {process.name} exited with code "
                                      f"{process.exitcode}")
                    return
            if not sentinels:
                return

    def drain(self) -> None:
        """Pass the drain on (SIGTERM to each); any thread, idempotent."""
        self._stopping.set()
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        """Wait until they have exited (drained, or failed by a dead core); kill any left."""
        self.drain()
        for process in self._processes:
            process.join(timeout_s)
            if process.is_alive():
                log.warning("API process %s did not exit in time; killing it", process.name)
                process.kill()
                process.join(5)


def make_shared_dir() -> Path:
    """A private directory for the processes' ipc sockets and metrics files."""
    return Path(tempfile.mkdtemp(prefix="slipstream-api-"))


def run_api_process(address: ClientAddress, engine_config: EngineConfig,
                    server_config: ServerConfig, port: int) -> None:
    """API process ``address.client``'s whole life (a ``multiprocessing`` spawn target)."""
    from slipstream.agent.parallel.launch import die_with_parent

    die_with_parent()
    logging.basicConfig(level=server_config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from slipstream.agent.engine.errors import EngineDeadError
    from slipstream.agent.server.api import build_app
    from slipstream.agent.server.cli import AGENT_KEEPALIVE_S
    from slipstream.agent.engine.engine_loop import EXIT_CORE_DEAD
    from slipstream.agent.server.drain import DrainingServer
    from slipstream.agent.server.drain import server_config as server_config_for_uvicorn
    from slipstream.agent.server.engine_core import EngineCoreClient

    try:
        engine = EngineCoreClient(engine_config, attach=address)
    except EngineDeadError as error:
        log.error("API process %d cannot start: %s", address.client, error)
        raise SystemExit(EXIT_CORE_DEAD) from None
    listener = listening_socket(server_config.host, port)
    app = build_app(engine, server_config)
    engine.on_set_pool = app.state.serving.metrics.set_pool
    server = DrainingServer(server_config_for_uvicorn(
        app, host=server_config.host, port=port, log_level=server_config.log_level,
        keepalive_s=AGENT_KEEPALIVE_S, drain_timeout_s=server_config.drain_timeout_s,
        request_read_timeout_s=server_config.request_read_timeout_s),
        engine, server_config.drain_timeout_s)
    engine.on_fatal = lambda _reason: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[listener])
    except SystemExit:
        pass
    finally:
        engine.close()
    if engine.fatal_error is not None:
        raise SystemExit(EXIT_CORE_DEAD)
    raise SystemExit(0 if server.started else 2)
