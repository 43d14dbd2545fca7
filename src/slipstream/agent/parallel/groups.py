"""torch.distributed process groups of one worker: its TP group, its KVP group, its EP group
and its pipeline neighbours.

    worker start-up: init_process_groups(config, env, device) -> ProcessGroups
        -> TP layers (all-reduce / all-gather in ``tp_group``)
        -> KVP attention merge (all-gather in ``kvp_group``)
        -> expert outputs summed over the experts' ranks (all-reduce in ``ep_group``)
        -> stage hand-off (send to ``next_rank``, recv from ``prev_rank``)

The backend follows the device: NCCL on CUDA, gloo on CPU; the code above it is the same.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slipstream.agent.engine.parallel_config import ParallelConfig, RankCoords
from slipstream.agent.parallel.env import WorkerEnv

# Long enough for a large model to load on every rank; a dead peer is caught by the
# controller long before this fires.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class ProcessGroups:
    config: ParallelConfig
    coords: RankCoords
    tp_group: dist.ProcessGroup | None  # None when tp == 1
    kvp_group: dist.ProcessGroup | None  # None when kvp == 1
    ep_group: dist.ProcessGroup | None  # None when ep == 1
    prev_rank: int | None  # the previous stage's rank with the same TP rank and KVP group
    next_rank: int | None

    @property
    def tp_size(self) -> int:
        return self.config.tp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def ep_size(self) -> int:
        return self.config.ep

    @property
    def ep_rank(self) -> int:
        return self.coords.ep_rank


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_groups(config: ParallelConfig, env: WorkerEnv,
                        device: torch.device) -> ProcessGroups:
    if env.world_size != config.world_size:
        raise ValueError(f"world size {env.world_size} from the environment != tp*ep*spp*kvp = "
                         f"{config.world_size}")
    dist.init_process_group(backend_for(device),
                            init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, timeout=COLLECTIVE_TIMEOUT)
    coords = config.coords(env.rank)
    # Every rank must create every group, in the same order, even the ones it is not in.
    tp_group = kvp_group = ep_group = None
    for kvp_index in range(config.kvp):
        for stage in range(config.spp):
            for ep_rank in range(config.ep):
                ranks = config.tp_group_ranks(stage, kvp_index, ep_rank)
                group = dist.new_group(ranks) if config.tp > 1 else None
                if env.rank in ranks:
                    tp_group = _own(group)
    for stage in range(config.spp):
        for ep_rank in range(config.ep):
            for tp_rank in range(config.tp):
                ranks = config.kvp_group_ranks(tp_rank, stage, ep_rank)
                group = dist.new_group(ranks) if config.kvp > 1 else None
                if env.rank in ranks:
                    kvp_group = _own(group)
    for kvp_index in range(config.kvp):
        for stage in range(config.spp):
            for tp_rank in range(config.tp):
                ranks = config.ep_group_ranks(tp_rank, stage, kvp_index)
                group = dist.new_group(ranks) if config.ep > 1 else None
                if env.rank in ranks:
                    ep_group = _own(group)
    stage, tp_rank, ep_rank = coords.stage, coords.tp_rank, coords.ep_rank
    prev_rank = (config.rank_of(tp_rank, stage - 1, coords.kvp_group, ep_rank)
                 if stage > 0 else None)
    next_rank = (config.rank_of(tp_rank, stage + 1, coords.kvp_group, ep_rank)
                 if stage < config.spp - 1 else None)
    return ProcessGroups(config, coords, tp_group, kvp_group, ep_group, prev_rank, next_rank)


def _own(group: object) -> dist.ProcessGroup | None:
    """The group a member got back from new_group (non-members get a marker, not a group)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"new_group gave a member {group!r}, not a process group")
    return group


def destroy_process_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
