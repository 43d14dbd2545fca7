"""The engine-core process: builds ``LLMEngine`` and runs ``EngineLoop`` on it
(``run_engine_core``), the same loop an in-process server runs on a thread.

The loop drains whatever commands have arrived from the API processes (core_messages.py),
runs one step, and this module's port sends that step's outputs, stats and step summaries in
one ``Outputs`` message; it never waits on HTTP. With several API processes
(``--api-processes``) each gets its own requests' outputs and every step's stats. The API
side is engine_core.py.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
from typing import TYPE_CHECKING

import zmq

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine_loop import Add, Command, EngineLoop
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats, StepStats, StepSummary
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.server.core_messages import (
    Attach, Dead, Outputs, Ready, WarmedUp, command_decoder, encoder)

if TYPE_CHECKING:
    from slipstream.agent.engine.engine import LLMEngine

log = logging.getLogger(__name__)


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
        from slipstream.agent.engine.profile.auto_profile import with_runtime_profile

        # A first start profiles here, in the process and with the threads the steps use;
        # its progress lines are worth showing at this process's WARNING level.
        logging.getLogger("slipstream.agent.engine.profile.auto_profile").setLevel(logging.INFO)
        # So is the one line that says how large a KV cache was chosen, and why.
        logging.getLogger("slipstream.agent.engine.step.model_runner").setLevel(logging.INFO)
        # And the weight formats the model is served in, with the kernel each runs on.
        logging.getLogger("slipstream.agent.engine.models.loader").setLevel(logging.INFO)
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
            outputs.send(encoder.encode(Dead(failure)))
        else:
            try:
                # Everything loaded so far lives as long as the process; out of the
                # collector's generations it cannot cause pauses inside schedule().
                gc.collect()
                gc.freeze()
                outputs.send(encoder.encode(_ready(engine)))
                port = _SocketPort(engine, commands, outputs, context)
                try:
                    code = EngineLoop(engine, port).run()
                finally:
                    port.close_clients()
            finally:
                engine.close()
    finally:
        commands.close(0)
        outputs.close()  # lingers for the last message
        context.term()
    raise SystemExit(code)


def _ready(engine: LLMEngine) -> Ready:
    return Ready(engine.model_name, engine.limits, engine.stats(), sorted(engine.eos_token_ids))


class _SocketPort:
    """``EngineLoop``'s side of the ZeroMQ transport: commands from every API process,
    outputs to the one that sent each request, stats and step summaries to all of them."""

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

    def receive(self, timeout_s: float) -> list[Command]:
        if timeout_s > 0:
            self.poller.poll(int(timeout_s * 1000))
        commands: list[Command] = []
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK)
            except zmq.Again:
                return commands
            command = command_decoder.decode(raw)
            if isinstance(command, Attach):
                self._attach(command)
            else:
                commands.append(command)

    def added(self, command: Add, refusal: RequestOutput | None) -> None:
        if refusal is not None:
            # To the sender, whoever owns a request of that id.
            self.refused.setdefault(command.client, []).append(refusal)
        elif command.client != 0:
            self.owner[command.request.request_id] = command.client

    def send(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        steps, self.steps = self.steps, []
        by_client, self.refused = self.refused, {}
        if not self.clients:
            outputs = by_client.get(0, []) + outputs
            self.outputs.send(encoder.encode(Outputs(outputs, stats, steps)))
            return
        # Several API processes: each gets its own requests' outputs, and all of them the
        # same stats and step summaries (each exports the engine-level metrics itself).
        for output in outputs:
            client = self.owner.get(output.request_id, 0)
            if output.finished:
                self.owner.pop(output.request_id, None)
            by_client.setdefault(client, []).append(output)
        self.outputs.send(encoder.encode(Outputs(by_client.pop(0, []), stats, steps)))
        for client in self.clients:
            self._send_to(client, encoder.encode(Outputs(by_client.get(client, []), stats,
                                                          steps)))

    def warmed_up(self, error: str | None) -> None:
        self.steps.clear()
        self.outputs.send(encoder.encode(WarmedUp(error)))

    def dead(self, reason: str) -> None:
        dead = encoder.encode(Dead(reason))
        self.outputs.send(dead)
        for client in self.clients:
            self._send_to(client, dead)

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
        self._send_to(command.client, encoder.encode(_ready(self.engine)))

    def close_clients(self) -> None:
        for socket in self.clients.values():
            socket.close(0)
        self.clients.clear()
