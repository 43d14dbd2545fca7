"""The engine in a process of its own, so that HTTP and output work never stretch a step.

    API process (this module's EngineCoreClient)             engine-core process
      HTTP, tokenization, chat templates                       (run_engine_core)
      generate() --Add-------- ZeroMQ PUSH -> PULL ------->  scheduler, block manager,
      abort()    --Abort---------------------------------->  runner / parallel executor
      detokenization, stop strings, SSE, /metrics           loop: commands, step(), send
        <- Outputs (token ids, finish, stats, step summaries) -- PUSH -> PULL ------
        <- Dead (reason) when a worker or the core itself fails

Three modules: this one is the API process's end (``EngineCoreClient``, the ZeroMQ transport
of ``EngineClient``, and the text it adds to outputs); core_process.py is the engine-core
process (``run_engine_core``, which runs ``EngineLoop``, the loop an in-process server runs on
a thread); core_messages.py holds the messages between them.

Messages are msgpack via msgspec. The core never waits on HTTP: it drains whatever commands
have arrived, runs a step and sends that step's outputs in one message. Outputs carry token
ids, not text: the API process turns them into text and checks stop strings
(``TextStream``). When a stop string matches, the API process ends the request for its
client at once and tells the core to abort it (the core may have run a step or two more;
those tokens are dropped), as vLLM v1's output processor does.

Failure: if the core reports a dead worker, or its process exits, ``EngineClient``'s one
failure path runs: every open request gets an ``engine_dead`` error, ``healthy`` turns false
(so /health and new requests answer 503), and ``on_fatal`` lets the server exit non-zero.
The core process dies with its parent (``PR_SET_PDEATHSIG``), so it never outlives the API
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, cast

import msgspec
import zmq

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine_client import EngineClient, StepObserver, put_all
from slipstream.agent.engine.engine_loop import IDLE_CHECK_S, Abort, DropKV, Shutdown, WarmUp
from slipstream.agent.engine.errors import EngineDeadError
from slipstream.agent.engine.sampling.grammar import GrammarCompiler
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats, StepSummary
from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.engine.detokenizer import TextStream
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.request import FinishReason
from slipstream.agent.server.core_messages import (
    Attach, Dead, Outputs, Ready, SetPool, WarmedUp, WireCommand, core_decoder, encoder)
from slipstream.agent.server.core_process import run_engine_core

if TYPE_CHECKING:
    from slipstream.agent.server.api_processes import ClientAddress

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
AUTO_PROFILE_TIMEOUT_S = 3600.0  # added to the start timeout when the core may profile first
STOP_TIMEOUT_S = 30.0


class EngineCoreClient(EngineClient):
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
        super().__init__(on_fatal)
        self.config = config
        self.on_set_pool: Callable[[str], None] | None = None  # attached: pool moves
        # The first of several API processes: waits for the others before the core stops.
        self.before_shutdown: Callable[[], None] | None = None
        # A first start may profile the engine before building it (auto_profile.py): minutes
        # on a CPU, more on a loaded one; a start cut short would only profile again.
        if config.auto_profile and config.profile_dir is None:
            start_timeout_s += AUTO_PROFILE_TIMEOUT_S
        self._start_timeout_s = start_timeout_s
        self._ready: Ready | None = None
        self._observer: Callable[[StepSummary], None] | None = None
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
                message = core_decoder.decode(self._outputs.recv())
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
        raw = encoder.encode(message)
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

    def _text_of(self, request: EngineRequest) -> TextStream:
        return TextStream(self.tokenizer, request.prompt_token_ids, request.params.stop)

    def _send(self, command: WireCommand) -> None:
        raw = encoder.encode(command)
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
            message = core_decoder.decode(raw)
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
        put_all(by_loop)

    def _relay_dead(self, reason: str) -> None:
        self._relay(Dead(reason))


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

