"""The one place that reads environment variables for parallel execution.

Locally, ``slipstream serve --tp 2 --spp 2 --kvp 2`` needs none of them: it picks free ports
and starts every rank on this machine. Across nodes the operator sets them on each pod:

- ``SLIPSTREAM_WORLD_SIZE``: ranks in the instance (must equal ``tp * spp * kvp``).
- ``SLIPSTREAM_NODE_RANKS``: ranks this pod starts, e.g. ``8-15`` or ``0,1``; default all.
- ``SLIPSTREAM_CONTROLLER_ADDR``: ``host:port`` of the controller's ZeroMQ socket. The
  controller binds the port on every interface; workers connect to ``host``.
- ``MASTER_ADDR``, ``MASTER_PORT``: the torch.distributed rendezvous, hosted by rank 0.
- ``SLIPSTREAM_RANK``, ``SLIPSTREAM_LOCAL_RANK``: set by the node launcher on each worker
  process it starts (its global rank, and its device index on the node).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

RANK = "SLIPSTREAM_RANK"
LOCAL_RANK = "SLIPSTREAM_LOCAL_RANK"
WORLD_SIZE = "SLIPSTREAM_WORLD_SIZE"
NODE_RANKS = "SLIPSTREAM_NODE_RANKS"
CONTROLLER_ADDR = "SLIPSTREAM_CONTROLLER_ADDR"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"


@dataclass(frozen=True)
class NodeEnv:
    """What a node needs to start its share of an instance's ranks (controller or worker pod)."""

    world_size: int | None  # None: not set, take it from tp * spp * kvp
    node_ranks: tuple[int, ...] | None  # None: every rank (single-node)
    controller_addr: str | None  # None: local launch, the controller picks a port
    master_addr: str | None
    master_port: int | None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> NodeEnv:
        environ = os.environ if environ is None else environ
        world = environ.get(WORLD_SIZE)
        ranks = environ.get(NODE_RANKS)
        port = environ.get(MASTER_PORT)
        return cls(world_size=int(world) if world else None,
                   node_ranks=parse_ranks(ranks) if ranks else None,
                   controller_addr=environ.get(CONTROLLER_ADDR) or None,
                   master_addr=environ.get(MASTER_ADDR) or None,
                   master_port=int(port) if port else None)

    @property
    def is_multi_node(self) -> bool:
        return self.controller_addr is not None


@dataclass(frozen=True)
class WorkerEnv:
    """What one worker process reads at start-up; everything else comes from the controller."""

    rank: int
    local_rank: int
    world_size: int
    controller_addr: str  # host:port to connect to
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        environ = os.environ if environ is None else environ
        missing = [name for name in (RANK, WORLD_SIZE, CONTROLLER_ADDR, MASTER_ADDR, MASTER_PORT)
                   if not environ.get(name)]
        if missing:
            raise RuntimeError(f"a slipstream worker needs {', '.join(missing)} in its "
                               "environment (set by the node launcher)")
        rank = int(environ[RANK])
        return cls(rank=rank, local_rank=int(environ.get(LOCAL_RANK, rank)),
                   world_size=int(environ[WORLD_SIZE]), controller_addr=environ[CONTROLLER_ADDR],
                   master_addr=environ[MASTER_ADDR], master_port=int(environ[MASTER_PORT]))

    def to_environ(self) -> dict[str, str]:
        return {RANK: str(self.rank), LOCAL_RANK: str(self.local_rank),
                WORLD_SIZE: str(self.world_size), CONTROLLER_ADDR: self.controller_addr,
                MASTER_ADDR: self.master_addr, MASTER_PORT: str(self.master_port)}


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` -> ``(0, 1, 2, 3, 8)``."""
    ranks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{NODE_RANKS}={text!r} lists a rank twice")
    return tuple(ranks)
