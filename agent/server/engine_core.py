"""The engine in a process of its own, so that HTTP and output work never stretch a step.

    API process (this module's EngineCoreClient)             engine-core process
      HTTP, tokenization, chat templates                       (run_engine_core)
      generate() --Add-------- ZeroMQ PUSH -> PULL ------->  scheduler, block manager,
      abort()    --Abort---------------------------------->  runner / parallel executor
      detokenization, stop strings, SSE, /metrics           loop: commands, step(), send
        <- Outputs (token ids, finish, stats, step summaries) -- PUSH -> PULL ------
        <- Dead (reason) when a worker or the core itself fails

Messages are msgpack via msgspec. The core never waits on HTTP: it drains whatever commands
have arrived, runs a step and sends that step's outputs in one message. Outputs carry token
ids, not text: the API process turns them into text and checks stop strings
(``TextStream``). When a stop string matches, the API process ends the request for its
client at once and tells the core to abort it (the core may have run a step or two more;
those tokens are dropped), as vLLM v1's output processor does.

Failure: if the core reports a dead worker, or its process exits, every open request gets an
``engine_dead`` error, ``healthy`` turns false (so /health and new requests answer 503), and
``on_fatal`` lets the server exit non-zero. The core process dies with its parent
(``PR_SET_PDEATHSIG``), so it never outlives the API process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Protocol, cast

import msgspec
import zmq

from slipstream.agent.engine.async_engine import (
    DRAINED_MESSAGE, check_admission, dead_output, error_output, stream_outputs)
from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.errors import (
    DRAINED, ENGINE_ERROR, INVALID_REQUEST, EngineDeadError)
from slipstream.agent.engine.grammar import GrammarCompiler
from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.sampling_params import RequestOutput, SamplingParams
from slipstream.agent.engine.stats import EngineStats, StepStats, StepSummary
from slipstream.agent.engine.tokenizer import TextStream, Tokenizer
from slipstream.agent.scheduler.request import FinishReason, RequestSLO
from slipstream.agent.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from slipstream.agent.engine.async_engine import AsyncEngine
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.agent.server.api_processes import ClientAddress

log = logging.getLogger(__name__)

IDLE_CHECK_S = 0.5  # idle: how often the core re-checks its workers and sends fresh stats
START_TIMEOUT_S = 600.0
AUTO_PROFILE_TIMEOUT_S = 3600.0  # added to the start timeout when the core may profile first
STOP_TIMEOUT_S = 30.0
EXIT_CORE_DEAD = 3


# -- messages ---------------------------------------------------------------------------------

class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    app_id: str
    priority: int
    slo: RequestSLO | None
    kv_transfer: dict | None = None
    share_prompt_with: str | None = None
    client: int = 0  # the API process that sent it (--api-processes); its outputs go there


class Attach(msgspec.Struct, tag="attach", array_like=True):
    """Another API process (``--api-processes``), sent by the first one: take its commands
    from ``command_addr`` too, and send it a ``Ready``, then its requests' outputs and every
    step's stats and summaries at ``output_addr``."""
    client: int
    command_addr: str
    output_addr: str


class WarmUp(msgspec.Struct, tag="warm_up", array_like=True):
    pass


class CutInFlight(msgspec.Struct, tag="cut", array_like=True):
    """The drain period is over: fail every request in flight (``drained``)."""


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class DropKV(msgspec.Struct, tag="drop_kv", array_like=True):
    """Prefill role: a stop string (found here, in the API process) ended requests at their
    first token after the core had handed their KV off; free those holds."""
    transfer_ids: list[str]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_name: str
    limits: RequestLimits
    stats: EngineStats
    eos_token_ids: list[int]


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestOutput]
    stats: EngineStats
    steps: list[StepSummary]


class Dead(msgspec.Struct, tag="dead", array_like=True):
    reason: str


class WarmedUp(msgspec.Struct, tag="warmed_up", array_like=True):
    error: str | None


class SetPool(msgspec.Struct, tag="set_pool", array_like=True):
    """From the first API process to the others: label requests with this pool from now on
    (the operator moved the instance)."""
    pool: str


_encoder = msgspec.msgpack.Encoder()
Command = Add | Abort | Shutdown | WarmUp | CutInFlight | DropKV | Attach
_command_decoder = msgspec.msgpack.Decoder(Command)
_core_decoder = msgspec.msgpack.Decoder(Ready | Outputs | Dead | WarmedUp | SetPool)


# -- the engine-core process ------------------------------------------------------------------

def core_threads(requested: int = 0) -> int | None:
    """The torch CPU threads of the engine-core process: ``requested`` if positive; else None
    (torch's own choice) where ``OMP_NUM_THREADS`` says; else every CPU this process may use
    but one, which the API process keeps.

    Why not torch's default (one thread per CPU): the API process is busy on a CPU of its
    own, and an intra-op parallel region waits for its slowest thread; a thread that has to
    wait for that CPU stretches every operator of every step. Measured on a 2-CPU machine at
    1,000 streams (tiny model): 2 threads gave 110-280 output tok/s, 1 thread 798.
    """
    if requested > 0:
        return requested
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, len(os.sched_getaffinity(0)) - 1)


def run_engine_core(config: EngineConfig, scheduler_config: SchedulerConfig | None,
                    command_addr: str, output_addr: str, threads: int = 0) -> None:
    """The engine-core process's whole life (a ``multiprocessing`` spawn target)."""
    import torch

    from slipstream.agent.parallel.compose import build_engine
    from slipstream.agent.parallel.launch import die_with_parent

    die_with_parent()
    # Ctrl-C reaches the whole process group; the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The engine first: a parallel executor forks its workers, and they must not inherit
    # this process's ZeroMQ context (its I/O threads do not survive a fork).
    engine: LLMEngine | None = None
    failure = ""
    try:
        from slipstream.agent.engine.auto_profile import with_runtime_profile

        # A first start profiles here, in the process and with the threads the steps use;
        # its progress lines are worth showing at this process's WARNING level.
        logging.getLogger("slipstream.agent.engine.auto_profile").setLevel(logging.INFO)
        # So is the one line that says how large a KV cache was chosen, and why.
        logging.getLogger("slipstream.agent.engine.model_runner").setLevel(logging.INFO)
        config = with_runtime_profile(config, core_threads(threads))
        engine = build_engine(config, scheduler_config, output_text=False)
    except Exception as error:  # noqa: BLE001 - tell the API process why, then exit
        failure = str(error) or type(error).__name__
    # After the build: loading and allocating the KV cache keep all threads; the steps, which
    # share the machine with the API process, get one CPU fewer (``core_threads``).
    if (count := core_threads(threads)) is not None:
        torch.set_num_threads(count)
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(command_addr)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.connect(output_addr)
    code = 2
    try:
        if engine is None:
            outputs.send(_encoder.encode(Dead(failure)))
        else:
            try:
                # Everything loaded so far lives as long as the process; out of the
                # collector's generations it cannot cause pauses inside schedule().
                gc.collect()
                gc.freeze()
                outputs.send(_encoder.encode(_ready(engine)))
                loop = _CoreLoop(engine, commands, outputs, context)
                try:
                    code = loop.run()
                finally:
                    loop.close_clients()
            finally:
                engine.close()
    finally:
        commands.close(0)
        outputs.close()  # lingers for the last message
        context.term()
    raise SystemExit(code)


def _ready(engine: LLMEngine) -> Ready:
    return Ready(engine.model_name, engine.limits, engine.stats(), sorted(engine.eos_token_ids))


class _CoreLoop:
    def __init__(self, engine: LLMEngine, commands: zmq.Socket, outputs: zmq.Socket,
                 context: zmq.Context) -> None:
        self.engine = engine
        self.commands = commands
        self.outputs = outputs  # to the first API process (client 0)
        self.context = context
        self.poller = zmq.Poller()
        self.poller.register(commands, zmq.POLLIN)
        self.steps: list[StepSummary] = []
        # --api-processes: the other API processes' output sockets, which API process sent
        # each request in flight, and refusals owed to a client other than the first.
        self.clients: dict[int, zmq.Socket] = {}
        self.owner: dict[str, int] = {}
        self.refused: dict[int, list[RequestOutput]] = {}
        self.dropping: set[int] = set()  # clients whose outputs were dropped (logged once)
        engine.on_step = self._on_step

    def _on_step(self, step: StepStats) -> None:
        self.steps.append(StepSummary.of(step))

    def run(self) -> int:
        engine = self.engine
        while True:
            timeout_s = IDLE_CHECK_S if not engine.has_unfinished() else engine.idle_wait_s()
            outputs: list[RequestOutput] = []
            if timeout_s > 0:
                self.poller.poll(int(timeout_s * 1000))
            if not self._drain(outputs):
                outputs += self._fail_all(DRAINED_MESSAGE, DRAINED)
                self._send(outputs)
                return 0
            try:
                if engine.has_unfinished():
                    outputs += engine.step()
                else:
                    engine.check_alive()  # idle: nothing else would notice a dead worker
                    outputs += engine.poll_transfers()  # acknowledged KV hand-offs
            except EngineDeadError as error:
                log.error("the engine is dead: %s", error)
                dead = _encoder.encode(Dead(str(error)))
                self.outputs.send(dead)
                for client in self.clients:
                    self._send_to(client, dead)
                return EXIT_CORE_DEAD
            except Exception:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed; failing in-flight requests")
                outputs += self._fail_all("the engine failed while running this request",
                                          ENGINE_ERROR)
            self._send(outputs)

    def _send(self, outputs: list[RequestOutput]) -> None:
        steps, self.steps = self.steps, []
        stats = self.engine.stats()
        if not self.clients:
            self.outputs.send(_encoder.encode(Outputs(outputs, stats, steps)))
            return
        # Several API processes: each gets its own requests' outputs, and all of them the
        # same stats and step summaries (each exports the engine-level metrics itself).
        by_client, self.refused = self.refused, {}
        for output in outputs:
            client = self.owner.get(output.request_id, 0)
            if output.finished:
                self.owner.pop(output.request_id, None)
            by_client.setdefault(client, []).append(output)
        self.outputs.send(_encoder.encode(Outputs(by_client.pop(0, []), stats, steps)))
        for client in self.clients:
            self._send_to(client, _encoder.encode(Outputs(by_client.get(client, []), stats,
                                                          steps)))

    def _send_to(self, client: int, raw: bytes) -> None:
        """To an API process other than the first: never blocks the loop. A process that
        stops reading has died, and the first process then ends the server."""
        try:
            self.clients[client].send(raw, zmq.NOBLOCK)
        except zmq.Again:
            if client not in self.dropping:
                self.dropping.add(client)
                log.warning("API process %d is not reading its outputs; dropping them",
                            client)

    def _attach(self, command: Attach) -> None:
        self.commands.connect(command.command_addr)
        socket = self.context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(command.output_addr)
        self.clients[command.client] = socket
        self._send_to(command.client, _encoder.encode(_ready(self.engine)))

    def close_clients(self) -> None:
        for socket in self.clients.values():
            socket.close(0)
        self.clients.clear()

    def _drain(self, outputs: list[RequestOutput]) -> bool:
        """Apply every command that has arrived; False on shutdown."""
        engine = self.engine
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            command = _command_decoder.decode(raw)
            if isinstance(command, Add):
                try:
                    engine.add_request(command.prompt_token_ids, command.params,
                                       command.request_id, app_id=command.app_id,
                                       priority=command.priority, slo=command.slo,
                                       kv_transfer=command.kv_transfer,
                                       share_prompt_with=command.share_prompt_with)
                except ValueError as error:
                    refusal = error_output(command.request_id, str(error), INVALID_REQUEST)
                    if command.client == 0:
                        outputs.append(refusal)
                    else:  # to the sender, whoever owns a request of that id
                        self.refused.setdefault(command.client, []).append(refusal)
                    continue
                if command.client != 0:
                    self.owner[command.request_id] = command.client
                # Prefill role: the streaming KV handle goes out now, not after the step
                # that computes the first chunk.
                if (early := engine.handle_output(command.request_id)) is not None:
                    self._send(outputs + [early])
                    outputs.clear()
            elif isinstance(command, Abort):
                for request_id in command.request_ids:
                    if (output := engine.abort(request_id)) is not None:
                        outputs.append(output)
            elif isinstance(command, Attach):
                self._attach(command)
            elif isinstance(command, CutInFlight):
                outputs += self._fail_all(DRAINED_MESSAGE, DRAINED)
            elif isinstance(command, DropKV):
                for transfer_id in command.transfer_ids:
                    engine.drop_kv(transfer_id)
            elif isinstance(command, WarmUp):
                self._warm_up()
            else:
                return False

    def _warm_up(self) -> None:
        try:
            self.engine.warm_up()
            error = None
        except EngineDeadError:
            raise
        except Exception as failure:  # noqa: BLE001 - the API process reports it
            error = str(failure) or type(failure).__name__
        self.steps.clear()
        self.outputs.send(_encoder.encode(WarmedUp(error)))

    def _fail_all(self, message: str, code: str) -> list[RequestOutput]:
        engine = self.engine
        return [output for request_id in list(engine.scheduler.requests)
                if (output := engine.abort(request_id, FinishReason.ERROR, message, code))]


# -- the API process's end --------------------------------------------------------------------

class StepObserver(Protocol):
    def observe(self, step: StepStats) -> None: ...

    def observe_summary(self, step: StepSummary) -> None: ...


class _Stream:
    """One request's open stream in the API process: where its outputs go, and its text."""

    __slots__ = ("loop", "queue", "text")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[RequestOutput],
                 text: TextStream) -> None:
        self.loop = loop
        self.queue = queue
        self.text: TextStream | None = text  # None once the final output went out


class EngineCoreClient:
    """The serving engine of the API process: same surface as ``AsyncEngine``, with the
    engine in its own process (see the module docstring)."""

    def __init__(self, config: EngineConfig, scheduler_config: SchedulerConfig | None = None,
                 on_fatal: Callable[[str], None] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, threads: int = 0,
                 wait: bool = True, attach: ClientAddress | None = None) -> None:
        """Spawn the engine core. With ``wait`` (the default) return once it has loaded;
        without, return at once and call ``wait_ready`` before using the engine, so the
        caller's own start-up work overlaps the core's.

        With ``attach`` (an API process after the first, ``--api-processes``): spawn
        nothing, bind the two addresses the first process told the core about
        (``attach_api_process``), and serve from the core that process runs."""
        self.config = config
        self.on_fatal = on_fatal
        self.on_set_pool: Callable[[str], None] | None = None  # attached: pool moves
        # The first of several API processes: waits for the others before the core stops.
        self.before_shutdown: Callable[[], None] | None = None
        self.fatal_error: str | None = None
        self.healthy = False
        self.draining = False  # set by drain(): takes no new requests, finishes the rest
        # A first start may profile the engine before building it (auto_profile.py): minutes
        # on a CPU, more on a loaded one; a start cut short would only profile again.
        if config.auto_profile and config.profile_dir is None:
            start_timeout_s += AUTO_PROFILE_TIMEOUT_S
        self._start_timeout_s = start_timeout_s
        self._ready: Ready | None = None
        self._observer: Callable[[StepSummary], None] | None = None
        self._streams: dict[str, _Stream] = {}
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._relays: list[zmq.Socket] = []  # to the other API processes (SetPool, Dead)
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._process: BaseProcess | None = None
        self.client = 0
        if attach is not None:
            self.client = attach.client
            self._commands.bind(attach.command_addr)
            self._outputs.bind(attach.output_addr)
        else:
            command_port = self._commands.bind_to_random_port("tcp://127.0.0.1")
            output_port = self._outputs.bind_to_random_port("tcp://127.0.0.1")
            # The core first: it has the long way to go (torch, the model); the tokenizer
            # loads here meanwhile.
            self._process = multiprocessing.get_context("spawn").Process(
                target=run_engine_core, name="slipstream-engine-core",
                args=(config, scheduler_config, f"tcp://127.0.0.1:{command_port}",
                      f"tcp://127.0.0.1:{output_port}", threads))
            self._process.start()
        try:
            self.tokenizer = Tokenizer.from_dir(config.model_dir)
            if wait:
                self.wait_ready()
        except BaseException:
            self.close()
            raise

    def wait_ready(self) -> None:
        """Wait until the core has loaded the engine (``EngineDeadError`` if it failed or
        did not answer in time); idempotent. Closes the core on failure."""
        if self._ready is not None:
            return
        try:
            ready = self._wait_ready(self._start_timeout_s)
        except BaseException:
            self.close()
            raise
        self._ready = ready
        self.model_name = ready.model_name
        self.limits = ready.limits
        self.max_model_len = ready.limits.max_model_len
        self._stats = ready.stats
        # Checks grammars for the API (structured outputs) before they reach the core.
        self.grammar = GrammarCompiler(self.tokenizer, ready.limits.vocab_size,
                                       ready.eos_token_ids)

    def _wait_ready(self, timeout_s: float) -> Ready:
        message = self._wait_for((Ready, Dead), timeout_s)
        if isinstance(message, Dead):
            raise EngineDeadError(message.reason)
        assert isinstance(message, Ready)
        return message

    def _wait_for(self, kinds: tuple[type, ...], timeout_s: float) -> msgspec.Struct:
        """The next message of one of ``kinds`` (before the output thread runs); others are
        dropped (idle stats)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._outputs.poll(200):
                message = _core_decoder.decode(self._outputs.recv())
                if isinstance(message, Dead):
                    raise EngineDeadError(message.reason)
                if isinstance(message, kinds):
                    return cast(msgspec.Struct, message)
            elif (code := self._core_exit_code()) is not None:
                raise EngineDeadError(f"the engine core exited with code {code} while "
                                      f"starting")
        raise EngineDeadError("the engine core did not answer within the timeout")

    def _core_exit_code(self) -> int | None:
        """The core's exit code once it has exited; None while it runs, and always in an
        attached API process (the first one tells it when the core dies)."""
        if self._process is None or self._process.is_alive():
            return None
        return self._process.exitcode if self._process.exitcode is not None else -1

    def attach_api_process(self, client: int, address: ClientAddress) -> None:
        """Serve API process ``client`` (``--api-processes``) from this core too: it binds
        ``address``; the core connects to it, and so does this process, to pass on pool
        moves and the core's death."""
        relay = self._context.socket(zmq.PUSH)
        relay.setsockopt(zmq.LINGER, 0)
        relay.connect(address.output_addr)
        with self._send_lock:
            self._relays.append(relay)
        self._send(Attach(client, address.command_addr, address.output_addr))

    def relay_pool(self, pool: str) -> None:
        """Tell the other API processes the instance now serves ``pool``; any thread."""
        self._relay(SetPool(pool))

    def _relay(self, message: SetPool | Dead) -> None:
        raw = _encoder.encode(message)
        with self._send_lock:
            for relay in self._relays:
                if not relay.closed:
                    with contextlib.suppress(zmq.ZMQError):
                        relay.send(raw, zmq.NOBLOCK)

    def set_step_observer(self, observer: StepObserver) -> None:
        self._observer = observer.observe_summary

    def stats(self) -> EngineStats:
        """The snapshot the core sent with its last step (or, idle, every half second)."""
        return self._stats

    async def start(self, *, warm_up: bool = False) -> None:
        """Start taking requests; with ``warm_up`` the core first serves one real request
        (``LLMEngine.warm_up``), so ``healthy`` means it has served. Raises if that fails."""
        if self._thread is not None:
            return
        if warm_up and self._process is not None:  # attached: the first process warmed it
            self._send(WarmUp())
            try:
                warmed = await asyncio.to_thread(self._wait_for, (WarmedUp,), START_TIMEOUT_S)
            except EngineDeadError as error:
                self.fatal_error = str(error)
                raise
            assert isinstance(warmed, WarmedUp)
            if warmed.error is not None:
                raise RuntimeError(f"the engine failed its warm-up: {warmed.error}")
        self.healthy = True
        self._thread = threading.Thread(target=self._receive, name="slipstream-core-outputs",
                                        daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Take no new requests (503) and let the ones in flight finish; any thread."""
        self.draining = True
        self.healthy = False

    def cut_in_flight(self) -> None:
        """End every request still in flight with a ``drained`` error; any thread."""
        self._send(CutInFlight())

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    async def shutdown(self) -> None:
        """Let the core fail what is left (drained), then stop it. An attached API process
        leaves the core running: it aborts its own requests, if any are left."""
        if self._process is None:
            if self.fatal_error is None and self._streams:
                self._send(Abort(list(self._streams)))
        else:
            if self.before_shutdown is not None:
                await asyncio.to_thread(self.before_shutdown)
            if self.fatal_error is None and self._process.is_alive():
                self._send(Shutdown())
                await asyncio.to_thread(self._process.join, STOP_TIMEOUT_S)
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5)
        self.healthy = False
        self.close()

    def close(self) -> None:
        """Stop the core process if it still runs (this process started it); idempotent."""
        self._stopping.set()
        if self._process is not None and self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        with self._send_lock:
            if not self._context.closed:
                for relay in self._relays:
                    relay.close(0)
                self._commands.close(0)
                self._outputs.close(0)
                self._context.term()

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 app_id: str = "default", priority: int = 0,
                 slo: RequestSLO | None = None,
                 kv_transfer: dict | None = None,
                 share_prompt_with: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError for bad input), then stream outputs as they are produced."""
        check_admission(self, request_id, prompt_token_ids, params)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), queue,
                                            TextStream(self.tokenizer, prompt_token_ids,
                                                       params.stop))
        self._send(Add(request_id, list(prompt_token_ids), params, app_id, priority, slo,
                       kv_transfer, share_prompt_with, self.client))
        if self.fatal_error is not None:  # died after the check above: answer now
            queue.put_nowait(dead_output(request_id))
        return stream_outputs(request_id, queue, self._streams,
                              lambda: self._send(Abort([request_id])))

    async def abort(self, request_id: str) -> None:
        self._send(Abort([request_id]))

    def _send(self, command: Command) -> None:
        raw = _encoder.encode(command)
        with self._send_lock:  # the event loop and the output thread both send
            if not self._context.closed:
                self._commands.send(raw)

    # -- the output thread ------------------------------------------------------------------

    def _receive(self) -> None:
        socket = self._outputs
        while not self._stopping.is_set():
            try:
                if not socket.poll(int(IDLE_CHECK_S * 1000)):
                    code = self._core_exit_code()
                    if code is not None and not self._stopping.is_set():
                        self._die(f"the engine core exited with code {code}")
                        return
                    continue
                raw = socket.recv()
            except zmq.ZMQError:
                return  # closed by shutdown
            message = _core_decoder.decode(raw)
            if isinstance(message, Outputs):
                self._stats = message.stats
                if self._observer is not None:
                    for step in message.steps:
                        self._observer(step)
                self._deliver(message.outputs)
            elif isinstance(message, Dead):
                self._die(message.reason)
                return
            elif isinstance(message, SetPool) and self.on_set_pool is not None:
                self.on_set_pool(message.pool)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        aborts = []
        drops = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or stream.text is None:
                continue  # its client left, or a stop string already ended it
            output, stopped = _add_text(stream.text, output)
            if output.finished:
                stream.text = None  # nothing more goes out
                if stopped:
                    aborts.append(output.request_id)
                if output.kv_transfer is not None and \
                        output.finish_reason != FinishReason.LENGTH.value:
                    # A stop string in the first token: the request ends here, so the KV
                    # the core handed off goes to nobody (as in one process).
                    drops.append(str(output.kv_transfer.get("transfer_id")))
                    output.kv_transfer = None
            by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        if aborts:
            self._send(Abort(aborts))
        if drops:
            self._send(DropKV(drops))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def fail(self, reason: str) -> None:
        """Treat the engine as dead (another API process of this server died); any thread."""
        if self.fatal_error is None:
            self._die(reason)

    def _die(self, reason: str) -> None:
        log.error("the engine core is dead, failing every request: %s", reason)
        self.fatal_error = reason
        self.healthy = False  # before the failures are delivered: they must read as 503
        self._deliver([dead_output(request_id) for request_id in list(self._streams)])
        self._relay(Dead(reason))
        if self.on_fatal is not None:
            self.on_fatal(reason)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


def _add_text(text: TextStream, output: RequestOutput) -> tuple[RequestOutput, bool]:
    """The output with its text, as ``LLMEngine`` makes it in one process; and whether a stop
    string ended the request here (its core is then still running it)."""
    tokens = output.new_token_ids
    if not tokens:
        return output, False
    stop_token = output.finished and output.stop_token
    pieces = []
    for index, token in enumerate(tokens):
        if stop_token and index == len(tokens) - 1:
            pieces.append(text.flush())  # a stop token or EOS: not shown
            output.new_text = "".join(pieces)
            return output, False
        piece, hit = text.add_token(token)
        pieces.append(piece)
        if hit:
            kept = index + 1
            dropped = len(tokens) - kept
            output.new_text = "".join(pieces)
            output.new_token_ids = tokens[:kept]
            output.num_output_tokens -= dropped
            if len(output.logprobs) == len(tokens):
                output.logprobs = output.logprobs[:kept]
            stopped_here = not output.finished
            output.finished, output.finish_reason = True, FinishReason.STOP.value
            return output, stopped_here
    if output.finished and output.kv_transfer is None and output.finish_reason in (
            FinishReason.LENGTH.value, FinishReason.STOP.value):
        # The length limit, or a grammar that is complete. Not a prefill-role hand-off: the
        # decode instance goes on from this token, so held text stays held, as in one process.
        pieces.append(text.flush())
    output.new_text = "".join(pieces)
    return output, False


if TYPE_CHECKING:
    # What the HTTP layer serves from: the engine on a thread of this process, or in its own.
    ServingEngine = AsyncEngine | EngineCoreClient
