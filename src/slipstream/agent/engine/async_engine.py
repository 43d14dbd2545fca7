"""The serving engine in one process: ``EngineLoop`` on a background thread, for the asyncio
HTTP server.

    HTTP handler --generate()--> command queue --> engine thread: EngineLoop (engine_loop.py)
    engine thread --RequestOutput--> loop.call_soon_threadsafe --> per-request asyncio.Queue

All engine state is touched by the engine thread only; the server talks to it through the
command queue. What the API side does (admission, streams, aborts, drain, the failure path)
is ``EngineClient`` (engine_client.py), shared with the engine-core process's client; this
module is only the transport: a queue in, ``call_soon_threadsafe`` out.

A step that fails because of one request fails only that request (``LLMEngine`` finds it,
see isolation.py). If a step still raises, every request in flight fails with an error output
and the engine keeps serving new requests. If it raises ``EngineDeadError`` (a worker process
died), the engine marks itself unhealthy first (the server then refuses new requests with
503), fails every request, stops, and calls ``on_fatal`` so the server can exit non-zero and
be restarted. Error outputs carry a code from ``errors.py`` and a message meant for clients;
exception text stays in the log.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine_client import EngineClient, StepObserver, put_all
from slipstream.agent.engine.engine_loop import Add, Command, EngineLoop, Shutdown
from slipstream.agent.engine.errors import EngineDeadError
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats
from slipstream.agent.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    # Not at run time: the API process of a two-process server imports this module's
    # neighbours for its admission checks and must not pay for torch and the model code.
    from slipstream.agent.engine.engine import LLMEngine


class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig, scheduler_config: SchedulerConfig | None = None,
                 engine: LLMEngine | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        super().__init__(on_fatal)
        if engine is None:
            from slipstream.agent.engine.engine import LLMEngine

            engine = LLMEngine(config, scheduler_config)
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.grammar = engine.grammar  # checks grammars for the API (thread-safe)
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.limits = engine.limits
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()

    def wait_ready(self) -> None:
        """Nothing to wait for: the engine loaded in the constructor (the engine-core
        client's twin of this waits for its process)."""

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its last iteration (no locking)."""
        return self._stats

    def set_step_observer(self, observer: StepObserver) -> None:
        """Per-step metrics: called on the engine thread; set it before ``start``."""
        self.engine.on_step = observer.observe

    def close(self) -> None:
        """Stop worker processes, if any."""
        self.engine.close()

    async def start(self, *, warm_up: bool = False) -> None:
        """Start the engine thread. With ``warm_up`` first run one real request through every
        rank (``LLMEngine.warm_up``): ``healthy`` then means the engine has served, not only
        that it loaded. Raises if the warm-up fails."""
        if self._thread is not None:
            return
        if warm_up:
            try:
                await asyncio.to_thread(self.engine.warm_up)
            except EngineDeadError as error:
                self.fatal_error = str(error)
                raise
            self._stats = self.engine.stats()
        loop = EngineLoop(self.engine, _QueuePort(self))
        self._thread = threading.Thread(target=loop.run, name="slipstream-engine", daemon=True)
        # Everything loaded so far (model, tokenizer, tables) lives for the whole process;
        # moving it out of the collector's generations keeps GC pauses out of schedule().
        gc.collect()
        gc.freeze()
        self.healthy = True
        self._thread.start()

    async def shutdown(self) -> None:
        """Fail what is left (drained), stop the engine thread and the workers."""
        self._send(Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.healthy = False
        self.engine.close()

    # -- the transport ----------------------------------------------------------------------

    def _send(self, command: Command) -> None:
        self._commands.put(command)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        put_all(by_loop)


class _QueuePort:
    """``EngineLoop``'s side of the in-process transport (engine thread)."""

    def __init__(self, client: AsyncEngine) -> None:
        self._client = client
        self._commands = client._commands

    def receive(self, timeout_s: float) -> list[Command]:
        commands: list[Command] = []
        try:
            if timeout_s > 0:
                commands.append(self._commands.get(timeout=timeout_s))
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def added(self, command: Add, refusal: RequestOutput | None) -> None:
        if refusal is not None:
            self._client._deliver([refusal])

    def send(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._client._stats = stats
        if outputs:
            self._client._deliver(outputs)

    def warmed_up(self, error: str | None) -> None:
        """Not asked for: the in-process warm-up runs before the loop starts."""

    def dead(self, reason: str) -> None:
        self._client._die(reason)

