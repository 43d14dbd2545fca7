"""What the HTTP layer serves from (``ServingEngine``), and the part of it both transports
share (``EngineClient``).

    HTTP handler --generate(EngineRequest)--> EngineClient: admission, open a stream
        --_send(Add)--> the transport --> EngineLoop (engine_loop.py)
    EngineLoop --outputs--> the transport --_deliver()--> per-request asyncio.Queue

Two transports implement ``_send`` and ``_deliver``: ``AsyncEngine`` (async_engine.py; the
loop on a thread of this process) and ``EngineCoreClient`` (server/engine_core.py; the loop in
an engine-core process, over ZeroMQ). Everything else here is theirs in common: admission
checks, streams, aborts on disconnect, draining, and the one failure path (``_die``): once
the engine is dead, ``healthy`` turns false (new requests and /health answer 503), every open
stream ends with an ``engine_dead`` error, and ``on_fatal`` lets the server exit non-zero.

A consumer that stops iterating (client disconnect, cancellation) aborts its request; the
loop applies the abort before it schedules the next step, so its KV blocks are free within
one iteration. Shutting down (SIGTERM) is a drain: ``drain()`` stops new requests, the ones
in flight run on, and ``cut_in_flight()`` ends whatever is left when the drain period runs
out, each with a ``drained`` error, so every stream still ends properly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine.engine_loop import Abort, Add, Command, CutInFlight, DropKV
from slipstream.agent.engine.errors import ENGINE_DEAD, EngineDeadError, EngineUnavailable
from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.step.outputs import error_output
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats, StepStats, StepSummary

if TYPE_CHECKING:
    from slipstream.agent.engine.config import EngineConfig
    from slipstream.agent.engine.sampling.grammar import GrammarCompiler
    from slipstream.agent.engine.tokenizer import Tokenizer
    from slipstream.agent.engine.detokenizer import TextStream

log = logging.getLogger(__name__)


class StepObserver(Protocol):
    def observe(self, step: StepStats) -> None: ...

    def observe_summary(self, step: StepSummary) -> None: ...


class ServingEngine(Protocol):
    """The serving engine the HTTP server, the control API and the drain talk to."""

    config: EngineConfig
    tokenizer: Tokenizer
    grammar: GrammarCompiler  # checks grammars before they reach the engine
    fatal_error: str | None
    healthy: bool
    draining: bool
    on_fatal: Callable[[str], None] | None
    model_name: str
    max_model_len: int
    limits: RequestLimits

    @property
    def num_in_flight(self) -> int: ...

    def is_in_flight(self, request_id: str) -> bool: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def release_kv(self, transfer_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def set_step_observer(self, observer: StepObserver) -> None: ...

    def wait_ready(self) -> None: ...

    async def start(self, *, warm_up: bool = False) -> None: ...

    def drain(self) -> None: ...

    def cut_in_flight(self) -> None: ...

    async def shutdown(self) -> None: ...

    def close(self) -> None: ...


class Admitting(Protocol):
    """What ``check_admission`` reads."""

    fatal_error: str | None
    draining: bool
    healthy: bool

    @property
    def limits(self) -> RequestLimits: ...

    def is_in_flight(self, request_id: str) -> bool: ...


def check_admission(engine: Admitting, request: EngineRequest) -> None:
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
    if engine.is_in_flight(request.request_id):
        raise ValueError(f"request id {request.request_id!r} is already in flight")
    engine.limits.validate(request.prompt_token_ids, request.params)  # immutable config only


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


class OpenStream:
    """One request's open stream: where its outputs go, and (engine-core process) its
    text, which the API process makes."""

    __slots__ = ("loop", "queue", "text")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[RequestOutput],
                 text: TextStream | None = None) -> None:
        self.loop = loop
        self.queue = queue
        self.text = text


class EngineClient:
    """The API side of a serving engine, less its transport (``_send``, ``_deliver``)."""

    client = 0  # which API process this is (--api-processes); the first is 0
    # Known once the engine has loaded (the transport sets them).
    model_name: str
    max_model_len: int
    limits: RequestLimits

    def __init__(self, on_fatal: Callable[[str], None] | None) -> None:
        self.on_fatal = on_fatal
        self.fatal_error: str | None = None  # set once the engine died
        self.healthy = False
        self.draining = False  # set by drain(): takes no new requests, finishes the rest
        self._streams: dict[str, OpenStream] = {}

    # -- the transport ----------------------------------------------------------------------

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _text_of(self, request: EngineRequest) -> TextStream | None:
        """The stream's text state, where this side makes the text (engine-core process)."""
        return None

    def _relay_dead(self, reason: str) -> None:
        """Tell whoever else serves from this engine that it died (other API processes)."""

    # -- requests ---------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError for bad input), then stream outputs as they are produced."""
        check_admission(self, request)
        request_id = request.request_id
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = OpenStream(asyncio.get_running_loop(), queue,
                                               self._text_of(request))
        self._send(Add(request, self.client))
        if self.fatal_error is not None:  # the engine died after the check above: answer now
            queue.put_nowait(dead_output(request_id))
        return stream_outputs(request_id, queue, self._streams,
                              lambda: self._send(Abort([request_id])))

    async def abort(self, request_id: str) -> None:
        self._send(Abort([request_id]))

    def release_kv(self, transfer_id: str) -> None:
        """Prefill role: free the KV held under ``transfer_id`` (a router whose decode leg
        found no decode instance); unknown ids are ignored. Any thread."""
        self._send(DropKV([transfer_id]))

    def drain(self) -> None:
        """Take no new requests (``healthy`` turns false, so /health and new requests say 503)
        and let the ones in flight finish. Safe to call from any thread."""
        self.draining = True
        self.healthy = False

    def cut_in_flight(self) -> None:
        """End every request still in flight with a ``drained`` error (the drain period ran
        out); their streams get an error event and ``[DONE]``. Safe to call from any thread."""
        self._send(CutInFlight())

    # -- the one failure path ---------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """Treat the engine as dead (another API process of this server died); any thread."""
        if self.fatal_error is None:
            self._die(reason)

    def _die(self, reason: str) -> None:
        log.error("the engine is dead, failing every request: %s", reason)
        self.fatal_error = reason
        self.healthy = False  # before the failures are delivered: they must read as 503
        # Every open stream, including requests not yet applied by the loop: nothing else
        # will ever answer them.
        self._deliver([dead_output(request_id) for request_id in list(self._streams)])
        self._relay_dead(reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)


def put_all(by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]]
            ) -> None:
    """Hand outputs to the event loops their streams live on (from any thread)."""
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)
