"""The one loop that drives ``LLMEngine`` while it serves (``EngineLoop``), and the commands
it takes.

    commands (Add, Abort, ...) --port.receive()--> EngineLoop: apply them, step() once
        --port.send(outputs, stats)--> the clients' streams
    an engine error --> fail every request in flight, keep serving
    a dead worker   --> port.dead(reason): the clients fail every open stream, stop

It runs on the engine thread of one process (``AsyncEngine``) or in the engine-core process
(``core_process.py``); a ``LoopPort`` is all that differs: an in-process queue, or ZeroMQ
sockets carrying these same commands as msgpack. The shape follows vLLM v1's ``EngineCore``
busy loop: apply whatever has arrived, step, send, and never wait on the API side.

When a step runs nothing while requests wait (AWD holds short prefills until their group is
due), the loop waits on its port until the engine's wakeup time: a new request still wakes it
at once, and nothing spins.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import msgspec

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine.errors import (
    DRAINED, ENGINE_ERROR, INVALID_REQUEST, EngineDeadError)
from slipstream.agent.engine.step.outputs import error_output
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats
from slipstream.agent.scheduler.request import FinishReason

if TYPE_CHECKING:
    from slipstream.agent.engine.engine import LLMEngine

log = logging.getLogger(__name__)

DRAINED_MESSAGE = ("the instance shut down before this request finished (its drain period "
                   "ran out); retry the request")
# With no request left, wake this often to notice a dead worker (nothing else would).
IDLE_CHECK_S = 0.5
EXIT_STOPPED = 0
EXIT_CORE_DEAD = 3


class Add(msgspec.Struct, tag="add", array_like=True):
    request: EngineRequest  # as prepare() built it
    client: int = 0  # the API process that sent it (--api-processes); its outputs go there


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class CutInFlight(msgspec.Struct, tag="cut", array_like=True):
    """The drain period is over: fail every request in flight (``drained``)."""


class DropKV(msgspec.Struct, tag="drop_kv", array_like=True):
    """Prefill role: free KV holds no decode instance will read (a stop string found by the
    API process ended the request at its first token, or a router found no decode
    instance)."""
    transfer_ids: list[str]


class WarmUp(msgspec.Struct, tag="warm_up", array_like=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = Add | Abort | CutInFlight | DropKV | WarmUp | Shutdown


class LoopPort(Protocol):
    """The loop's side of a transport: where commands come from and outputs go."""

    def receive(self, timeout_s: float) -> list[Command]:
        """The commands that have arrived, waiting up to ``timeout_s`` for the first."""
        ...

    def added(self, command: Add, refusal: RequestOutput | None) -> None:
        """``command`` was applied; ``refusal`` is its error output if the engine refused
        it (a bad request), for its sender."""
        ...

    def send(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """One iteration's outputs (maybe none) and the engine's stats after it."""
        ...

    def warmed_up(self, error: str | None) -> None: ...

    def dead(self, reason: str) -> None:
        """The engine died: every request still open fails (``engine_dead``)."""
        ...


class EngineLoop:
    """Drains commands, steps the engine and routes its outputs, until ``Shutdown`` or until
    the engine dies (``run`` returns the process's exit code)."""

    def __init__(self, engine: LLMEngine, port: LoopPort) -> None:
        self.engine = engine
        self.port = port

    def run(self) -> int:
        engine = self.engine
        port = self.port
        while True:
            # Idle: wait for work. Requests held (AWD) or stalled: wait for work or the
            # engine's wakeup, whichever comes first. Otherwise take what has arrived.
            timeout_s = IDLE_CHECK_S if not engine.has_unfinished() else engine.idle_wait_s()
            outputs: list[RequestOutput] = []
            try:
                if not self._apply(port.receive(timeout_s), outputs):
                    port.send(outputs + self.fail_all(DRAINED_MESSAGE, DRAINED), engine.stats())
                    return EXIT_STOPPED
                if engine.has_unfinished():
                    outputs += engine.step()
                else:
                    engine.check_alive()  # idle: nothing else would notice a dead worker
                    outputs += engine.poll_transfers()  # acknowledged KV hand-offs
            except EngineDeadError as error:
                log.error("the engine is dead, failing every request: %s", error)
                port.dead(str(error))
                return EXIT_CORE_DEAD
            except Exception:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed; failing in-flight requests")
                outputs += self.fail_all("the engine failed while running this request",
                                         ENGINE_ERROR)
            port.send(outputs, engine.stats())

    def _apply(self, commands: list[Command], outputs: list[RequestOutput]) -> bool:
        """Apply the commands in order; False at ``Shutdown`` (those after it are dropped)."""
        engine = self.engine
        for command in commands:
            if isinstance(command, Add):
                request_id = command.request.request_id
                try:
                    engine.add(command.request)
                except ValueError as error:
                    self.port.added(command, error_output(request_id, str(error),
                                                          INVALID_REQUEST))
                    continue
                self.port.added(command, None)
                # Prefill role: the streaming KV handle goes out now, not after the step
                # that computes the first chunk.
                if (early := engine.handle_output(request_id)) is not None:
                    self.port.send(outputs + [early], engine.stats())
                    outputs.clear()
            elif isinstance(command, Abort):
                for request_id in command.request_ids:
                    if (output := engine.abort(request_id)) is not None:
                        outputs.append(output)
            elif isinstance(command, CutInFlight):
                outputs += self.fail_all(DRAINED_MESSAGE, DRAINED)
            elif isinstance(command, DropKV):
                for transfer_id in command.transfer_ids:
                    engine.drop_kv(transfer_id)
            elif isinstance(command, WarmUp):
                self._warm_up()
            else:
                return False
        return True

    def _warm_up(self) -> None:
        try:
            self.engine.warm_up()
            error = None
        except EngineDeadError:
            raise
        except Exception as failure:  # noqa: BLE001 - the client reports it
            error = str(failure) or type(failure).__name__
        self.port.warmed_up(error)

    def fail_all(self, message: str, code: str) -> list[RequestOutput]:
        """End every request the engine holds with an error output (``code``)."""
        engine = self.engine
        return [output for request_id in list(engine.scheduler.requests)
                if (output := engine.abort(request_id, FinishReason.ERROR, message, code))]
