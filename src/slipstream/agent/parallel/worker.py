"""The worker process: owns one rank, runs every batch the controller sends, in order.

    node launcher (launch.py) -> run_worker(WorkerEnv)   or, by hand,
    python -m slipstream.agent.parallel.worker            (rank etc. in the environment)
      -> connect to the controller -> HELLO -> INIT (engine config) -> process groups, model shard
      -> READY -> loop: BATCH (a diff) -> WorkerTables.apply -> StageRunner.run
                        -> (sampler rank) [MASKS of a masked batch, read once the logits are
                           ready] -> RESULT

Batches are handled strictly in arrival order on every rank. That order is what makes the
pipeline safe: a stage always writes a chunk's KV before it reads the next chunk, and
collectives are issued in the same sequence on every member of a group.

A worker never outlives its controller: it exits when the controller's connection drops (even
while blocked in a collective), and a locally started worker also dies with its parent
process (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.sampling.sampler import GrammarMasks
from slipstream.agent.parallel.env import WorkerEnv
from slipstream.agent.parallel.transport import (
    BATCH, ERROR, HELLO, INIT, MASKS, READY, RESULT, STOP, TRACE, TRACE_REPLY, WorkerSocket,
    decode_batch, decode_masks, decode_object, encode_object, encode_sampled)

log = logging.getLogger("slipstream.worker")
EXIT_CONTROLLER_LOST = 3


@dataclass(frozen=True)
class WorkerInit:
    """What the controller tells every worker after HELLO."""

    engine_config: EngineConfig


def worker_device(requested: str, local_rank: int) -> torch.device:
    wants_cuda = requested.startswith("cuda") or (requested == "auto" and torch.cuda.is_available())
    if not wants_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but CUDA is not available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def serve_forever(env: WorkerEnv) -> int:
    from slipstream.agent.parallel.groups import destroy_process_groups, init_process_groups
    from slipstream.agent.parallel.stage_runner import StageRunner
    from slipstream.agent.parallel.wire import WorkerTables

    sock = WorkerSocket(env.controller_addr, env.rank)
    sock.watch_controller(lambda: os._exit(EXIT_CONTROLLER_LOST))
    sock.send(HELLO)
    kind, frames = sock.recv()
    if kind == STOP:
        return 0
    init: WorkerInit = decode_object(frames[0])
    try:
        config = init.engine_config
        # One CPU thread: the ranks share the cores, and OpenMP's pool does not survive the
        # fork that started this process (see launch.py).
        torch.set_num_threads(1)
        device = worker_device(config.device, env.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        groups = init_process_groups(config.parallel, env, device)
        runner = StageRunner(config, ModelConfig.from_dir(config.model_dir), groups, device)
        sock.send(READY, encode_object(runner.num_kv_blocks))
        tables = WorkerTables()
        while True:
            kind, frames = sock.recv()
            if kind == BATCH:
                batch_seq, wire = decode_batch(frames)
                masks = (_masks_reader(sock, batch_seq)
                         if wire.masked and runner.is_sampler else None)
                sampled = runner.run(batch_seq, tables.apply(wire), masks)
                if sampled is not None:
                    sock.send(RESULT, *encode_sampled(batch_seq, sampled))
            elif kind == TRACE:
                sock.send(TRACE_REPLY, encode_object(list(runner.spans)))
            elif kind == STOP:
                runner.finish_sends()
                break
    except Exception:  # noqa: BLE001 - report anything to the controller, then die
        message = f"rank {env.rank}: {traceback.format_exc()}"
        log.error("%s", message)
        sock.send(ERROR, message.encode())
        sock.close()
        return 1
    sock.close()
    destroy_process_groups()
    return 0


def _masks_reader(sock: WorkerSocket, batch_seq: int) -> Callable[[], GrammarMasks]:
    """The sampler's mask source for a masked batch: the controller sends the masks right
    after the batch, so they are the next message on this connection."""
    def read() -> GrammarMasks:
        kind, frames = sock.recv()
        if kind != MASKS:
            raise RuntimeError(f"expected the grammar masks of batch {batch_seq}, got a "
                               f"{kind!r} message")
        seq, masks = decode_masks(frames)
        if seq != batch_seq:
            raise RuntimeError(f"got the grammar masks of batch {seq} while sampling batch "
                               f"{batch_seq}")
        return masks
    return read


def run_worker(env: WorkerEnv) -> None:
    """A worker process's whole life; never returns."""
    from slipstream.agent.parallel.launch import die_with_parent

    die_with_parent()
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group; the controller decides when
    # workers stop, so they ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a worker is stuck
    code = serve_forever(env)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo/NCCL threads can hang it, and there is nothing to flush.
    os._exit(code)


if __name__ == "__main__":
    run_worker(WorkerEnv.from_environ())
