"""Starting and stopping this node's worker processes; ``slipstream worker`` for extra nodes.

    one node:   slipstream serve --tp 2 --spp 2 --kvp 2   (the controller starts all 8 ranks)
    many nodes: controller pod  slipstream serve ...      (starts SLIPSTREAM_NODE_RANKS)
                other pods      slipstream worker         (start their SLIPSTREAM_NODE_RANKS)

Workers are forked (not spawned) from the process that starts them, which has already
imported torch and the model code: starting 8 ranks costs no import at all, where spawning
costs seconds per rank on a busy CPU (vLLM forks for the same reason). What makes it safe:
- it happens before the starter creates threads of its own (its ZeroMQ socket comes after);
- the controller never touches the device, so each worker initialises CUDA itself; should
  CUDA already be initialised in this process, workers are spawned instead;
- OpenMP's thread pool does not survive a fork (a child that uses several threads after its
  parent did can hang), so a forked worker computes on one CPU thread. On GPU that costs
  nothing; on CPU, parallel serving is for correctness, not speed.

Children die with the process that started them: the fork server exits when its parent does,
and each worker asked Linux for SIGKILL when its parent goes (``PR_SET_PDEATHSIG``); a worker
also exits when the controller's connection drops. ``LocalWorkers.stop`` terminates, then
kills, whatever is left. No orphan keeps a GPU or a port.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import multiprocessing
import signal
import socket
import sys
import time

from slipstream.agent.parallel.env import NodeEnv, WorkerEnv

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT, which torch binds itself)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class LocalWorkers:
    """The worker processes this node started, one per rank."""

    def __init__(self, ranks: tuple[int, ...], world_size: int, controller_addr: str,
                 master_addr: str, master_port: int) -> None:
        from slipstream.agent.parallel.worker import run_worker

        torch = sys.modules.get("torch")
        cuda_started = torch is not None and torch.cuda.is_initialized()
        context = (multiprocessing.get_context("spawn") if cuda_started
                   else multiprocessing.get_context("fork"))
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        for local_rank, rank in enumerate(ranks):
            env = WorkerEnv(rank=rank, local_rank=local_rank, world_size=world_size,
                            controller_addr=controller_addr, master_addr=master_addr,
                            master_port=master_port)
            process = context.Process(target=run_worker, args=(env,), name=f"slipstream-rank-{rank}")
            process.start()
            self.processes[rank] = process

    @property
    def pids(self) -> dict[int, int]:
        return {rank: process.pid for rank, process in self.processes.items()
                if process.pid is not None}

    def exited(self) -> dict[int, int]:
        """Ranks whose process has exited, with its exit code (negative: killed by a signal)."""
        return {rank: process.exitcode for rank, process in self.processes.items()
                if process.exitcode is not None}

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask politely (SIGTERM), then SIGKILL whatever is still there after ``grace_s``."""
        for process in self.processes.values():
            if process.exitcode is None:
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()


# -- `slipstream worker`: a node that holds ranks but not the controller ----------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Start this node's share of a multi-node instance's worker ranks and wait for them. "
        "Configured by environment variables, as the operator sets them: "
        "SLIPSTREAM_WORLD_SIZE, SLIPSTREAM_NODE_RANKS (e.g. 8-15), "
        "SLIPSTREAM_CONTROLLER_ADDR (host:port), MASTER_ADDR, MASTER_PORT. "
        "Exits non-zero as soon as any rank fails, so the pod restarts.")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = NodeEnv.from_environ()
    if (env.world_size is None or env.node_ranks is None or env.controller_addr is None
            or env.master_addr is None or env.master_port is None):
        missing = [name for name, value in (("SLIPSTREAM_WORLD_SIZE", env.world_size),
                                            ("SLIPSTREAM_NODE_RANKS", env.node_ranks),
                                            ("SLIPSTREAM_CONTROLLER_ADDR", env.controller_addr),
                                            ("MASTER_ADDR", env.master_addr),
                                            ("MASTER_PORT", env.master_port)) if value is None]
        log.error("slipstream worker needs %s in its environment", ", ".join(missing))
        return 2
    workers = LocalWorkers(env.node_ranks, env.world_size, env.controller_addr,
                           env.master_addr, env.master_port)

    def stop(*_: object) -> None:
        workers.stop()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    log.info("started ranks %s", list(workers.pids))
    try:
        while True:
            exited = workers.exited()
            if any(code != 0 for code in exited.values()) or len(exited) == len(workers.processes):
                break
            time.sleep(0.5)
    finally:
        workers.stop()
    failed = {rank: code for rank, code in workers.exited().items() if code != 0}
    if failed:
        log.error("worker ranks failed: %s", failed)
        return 1
    return 0
