"""Runs the synchronous ``LLMEngine`` on a background thread for the asyncio HTTP server.

    HTTP handler --generate()--> command queue --> engine thread: add / abort, step()
    engine thread --RequestOutput--> loop.call_soon_threadsafe --> per-request asyncio.Queue

All engine state is touched by the engine thread only; the server talks to it through the
command queue. A consumer that stops iterating (client disconnect, cancellation) aborts its
request, and the abort is applied before the next step is scheduled, so its KV blocks are free
within one iteration. A step that fails because of one request fails only that request
(``LLMEngine`` finds it, see isolation.py). If a step still raises, every request in flight
fails with an error output and the engine keeps serving new requests. If it raises
``EngineDeadError`` (a worker process died), the engine marks itself unhealthy first (the
server then refuses new requests with 503), fails every request, stops, and calls
``on_fatal`` so the server can exit non-zero and be restarted. Error outputs carry a code
from ``errors.py`` and a message meant for clients; exception text stays in the log.

Shutting down (SIGTERM) is a drain: ``drain()`` stops new requests, the ones in flight run on,
and ``cut_in_flight()`` ends whatever is left when the drain period runs out, each with a
``drained`` error output, so every stream still ends properly.

When a step runs nothing while requests wait (AWD holds short prefills until their group is
due), the thread sleeps on the command queue until the engine's wakeup time: a new request
still wakes it at once, and nothing spins.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.errors import (
    DRAINED, ENGINE_DEAD, ENGINE_ERROR, INVALID_REQUEST, EngineDeadError, EngineUnavailable)
from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.step.outputs import error_output
from slipstream.agent.engine.sampling.params import RequestOutput, SamplingParams
from slipstream.agent.engine.step.stats import EngineStats, StepStats
from slipstream.agent.scheduler.request import FinishReason, RequestSLO
from slipstream.agent.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    # Not at run time: the API process of a two-process server imports this module for
    # its admission checks and must not pay for torch and the model code.
    from slipstream.agent.engine.engine import LLMEngine

log = logging.getLogger(__name__)

DRAINED_MESSAGE = ("the instance shut down before this request finished (its drain period "
                   "ran out); retry the request")
# With no request left, wake this often to notice a dead worker (nothing else would).
IDLE_CHECK_S = 0.5


class StepObserver(Protocol):
    def observe(self, step: StepStats) -> None: ...


class Admitting(Protocol):
    """What ``check_admission`` reads: this module's ``AsyncEngine`` or the API process's
    ``EngineCoreClient`` (engine in its own process)."""

    fatal_error: str | None
    draining: bool
    healthy: bool

    @property
    def limits(self) -> RequestLimits: ...

    def is_in_flight(self, request_id: str) -> bool: ...


def check_admission(engine: Admitting, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
    """What a serving engine checks before it takes a request, in this order: a dead engine
    (``EngineDeadError``, 503), a draining or stopped one (``EngineUnavailable``, 503), a
    request id already in flight and a request that can never be served (``ValueError``,
    400)."""
    if engine.fatal_error is not None:
        raise EngineDeadError("the engine of this instance failed; retry on another instance")
    if engine.draining:
        raise EngineUnavailable("this instance is shutting down; retry on another instance")
    if not engine.healthy:
        raise EngineUnavailable("the engine is not running")
    if engine.is_in_flight(request_id):
        raise ValueError(f"request id {request_id!r} is already in flight")
    engine.limits.validate(prompt_token_ids, params)  # immutable config only


def dead_output(request_id: str) -> RequestOutput:
    """The final output of a request whose engine died under it."""
    return error_output(request_id, "the engine of this instance failed; retry the request",
                        ENGINE_DEAD)


async def stream_outputs(request_id: str, stream: asyncio.Queue[RequestOutput],
                         streams: dict, abort: Callable[[], None]
                         ) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs until its final one; then, or when the consumer stops
    early, forget its stream, and abort it in the engine if it had not finished."""
    finished = False
    try:
        while not finished:
            output = await stream.get()
            finished = output.finished
            yield output
    finally:
        streams.pop(request_id, None)
        if not finished:
            abort()


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    app_id: str
    priority: int
    slo: RequestSLO | None
    kv_transfer: dict | None = None
    share_prompt_with: str | None = None
    share_weight: float = 1.0


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _CutInFlight:
    """Command: fail every request in flight (the drain period is over)."""


@dataclass(frozen=True)
class _DropKV:
    """Command: free a KV hold no decode instance will read (prefill role)."""

    transfer_id: str


_CUT = _CutInFlight()


class AsyncEngine:
    def __init__(self, config: EngineConfig, scheduler_config: SchedulerConfig | None = None,
                 engine: LLMEngine | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        if engine is None:
            from slipstream.agent.engine.engine import LLMEngine

            engine = LLMEngine(config, scheduler_config)
        self.engine = engine
        self.on_fatal = on_fatal
        self.fatal_error: str | None = None  # set once the engine died
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.grammar = self.engine.grammar  # checks grammars for the API (thread-safe)
        self._commands: queue.SimpleQueue[_Add | _Abort | _CutInFlight | _DropKV | None] = \
            queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.healthy = False
        self.draining = False  # set by drain(): takes no new requests, finishes the rest
        self._stats = self.engine.stats()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def wait_ready(self) -> None:
        """Nothing to wait for: the engine loaded in the constructor (the engine-core
        client's twin of this waits for its process)."""

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its last step (no locking needed)."""
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
        self._thread = threading.Thread(target=self._run, name="slipstream-engine", daemon=True)
        # Everything loaded so far (model, tokenizer, tables) lives for the whole process;
        # moving it out of the collector's generations keeps GC pauses out of schedule().
        gc.collect()
        gc.freeze()
        self.healthy = True
        self._thread.start()

    def drain(self) -> None:
        """Take no new requests (``healthy`` turns false, so /health and new requests say 503)
        and let the ones in flight finish. Safe to call from any thread."""
        self.draining = True
        self.healthy = False

    def cut_in_flight(self) -> None:
        """End every request still in flight with a ``drained`` error (the drain period ran
        out); their streams get an error event and ``[DONE]``. Safe to call from any thread."""
        self._commands.put(_CUT)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    @property
    def limits(self) -> RequestLimits:
        return self.engine.limits

    async def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.healthy = False
        self.engine.close()

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 app_id: str = "default", priority: int = 0,
                 slo: RequestSLO | None = None,
                 kv_transfer: dict | None = None,
                 share_prompt_with: str | None = None,
                 share_weight: float = 1.0) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError for bad input), then stream outputs as they are produced."""
        check_admission(self, request_id, prompt_token_ids, params)
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, app_id, priority, slo,
                                kv_transfer, share_prompt_with, share_weight))
        if self.fatal_error is not None:  # the engine died after the check above: answer now
            self._deliver(dead_output(request_id))
        return stream_outputs(request_id, stream, self._streams,
                              lambda: self._commands.put(_Abort(request_id)))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def release_kv(self, transfer_id: str) -> None:
        """Prefill role: free the KV held under ``transfer_id`` (a router whose decode leg
        found no decode instance); unknown ids are ignored. Any thread."""
        self._commands.put(_DropKV(transfer_id))

    # -- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            # Idle: wait for work. Requests held (AWD) or stalled: wait for work or the engine's
            # wakeup, whichever comes first. Otherwise just drain what has arrived.
            timeout_s = IDLE_CHECK_S if not engine.has_unfinished() else engine.idle_wait_s()
            if not self._drain_commands(timeout_s):
                break
            if not engine.has_unfinished():
                try:  # idle: nothing else would notice a worker dying until the next request
                    engine.check_alive()
                except EngineDeadError as error:
                    self._die(str(error))
                    return
                for output in engine.poll_transfers():  # acknowledged KV hand-offs
                    self._deliver(output)
                self._stats = engine.stats()  # idle: let the load window decay
                continue
            try:
                outputs = engine.step()
            except EngineDeadError as error:
                self._die(str(error))
                return
            except Exception:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed; failing in-flight requests")
                outputs = self._fail_all("the engine failed while running this request",
                                         ENGINE_ERROR)
            self._stats = engine.stats()
            for output in outputs:
                self._deliver(output)
        for output in self._fail_all(DRAINED_MESSAGE, DRAINED):
            self._deliver(output)

    def _die(self, reason: str) -> None:
        log.error("the engine is dead, failing every request: %s", reason)
        self.fatal_error = reason
        self.healthy = False  # before the failures are delivered: they must read as 503
        # Every open stream, including requests still queued as commands: nothing else will
        # ever answer them.
        for request_id in list(self._streams):
            self._deliver(dead_output(request_id))
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _drain_commands(self, timeout_s: float) -> bool:
        """Apply every queued command, waiting up to ``timeout_s`` for the first; False once
        the shutdown sentinel arrives."""
        block = timeout_s > 0
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.prompt_token_ids, command.params,
                                            command.request_id, app_id=command.app_id,
                                            priority=command.priority, slo=command.slo,
                                            kv_transfer=command.kv_transfer,
                                            share_prompt_with=command.share_prompt_with,
                                            share_weight=command.share_weight)
                except ValueError as error:
                    self._deliver(error_output(command.request_id, str(error),
                                                INVALID_REQUEST))
                else:
                    # Prefill role: the streaming KV handle goes out before any step.
                    if (early := self.engine.handle_output(command.request_id)) is not None:
                        self._deliver(early)
            elif isinstance(command, _CutInFlight):
                for failed in self._fail_all(DRAINED_MESSAGE, DRAINED):
                    self._deliver(failed)
            elif isinstance(command, _DropKV):
                self.engine.drop_kv(command.transfer_id)
            else:
                output = self.engine.abort(command.request_id)
                if output is not None:
                    self._deliver(output)
            self._stats = self.engine.stats()

    def _fail_all(self, message: str, code: str) -> list[RequestOutput]:
        return [output for request_id in list(self.engine.scheduler.requests)
                if (output := self.engine.abort(request_id, FinishReason.ERROR, message, code))]

    def _deliver(self, output: RequestOutput) -> None:
        target = self._streams.get(output.request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, output)
