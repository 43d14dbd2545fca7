"""The shape of one serving instance: ``tp x ep x spp x kvp`` ranks, and where each rank sits.

    slipstream serve --tp --ep --spp --kvp  ->  ParallelConfig  ->  controller (executor) and
                                                                   every worker (RankCoords)

Rank layout, fastest-varying first: tensor-parallel rank, then expert-parallel rank, then
pipeline stage, then KVP group, i.e. ``rank = ((kvp_group * spp + stage) * ep + ep_rank) * tp
+ tp_rank``. A TP group is ``tp`` consecutive ranks, so it stays on one node when nodes hold
whole multiples of ``tp``; an EP group (``ep`` TP groups) stays on one node when nodes hold
multiples of ``tp * ep``. Every KVP group is a full pipeline (all layers over ``spp``
stages); KV-cache parallelism splits a request's sequence, not the model.

Expert parallelism splits a mixture of experts' experts over ``ep`` ranks; everything else
(attention, norms, the router, shared experts) is replicated over them, and every EP rank runs
the same batch (models/moe.py, agent/parallel/layers.py). With ``ep == 1`` the layout is the
``tp x spp x kvp`` one.

It lives with the engine's configuration, below ``agent/parallel``: the engine sizes its KV
cache and context from it, and the parallel workers (which import the engine) read it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.agent.scheduler.block_manager import BLOCK_SIZE


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    spp: int = 1
    kvp: int = 1
    ep: int = 1  # expert parallel: each rank holds num_experts / ep experts
    # Progressive KVP: a request's KV fills one group up to this many tokens, then the next.
    kvp_tokens_per_group: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("tp", "spp", "kvp", "ep"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.kvp_tokens_per_group < BLOCK_SIZE or self.kvp_tokens_per_group % BLOCK_SIZE:
            raise ValueError(f"kvp_tokens_per_group must be a positive multiple of the KV block "
                             f"size ({BLOCK_SIZE}), got {self.kvp_tokens_per_group}")

    @property
    def world_size(self) -> int:
        return self.tp * self.ep * self.spp * self.kvp

    @property
    def is_single_process(self) -> bool:
        return self.world_size == 1

    @property
    def max_context_tokens(self) -> int:
        """Beyond this a request would need a KVP group the instance does not have."""
        return self.kvp * self.kvp_tokens_per_group

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp_rank = rank % self.tp
        ep_rank = (rank // self.tp) % self.ep
        stage = (rank // (self.tp * self.ep)) % self.spp
        kvp_group = rank // (self.tp * self.ep * self.spp)
        return RankCoords(rank=rank, tp_rank=tp_rank, stage=stage, kvp_group=kvp_group,
                          ep_rank=ep_rank)

    def rank_of(self, tp_rank: int, stage: int, kvp_group: int, ep_rank: int = 0) -> int:
        return ((kvp_group * self.spp + stage) * self.ep + ep_rank) * self.tp + tp_rank

    def tp_group_ranks(self, stage: int, kvp_group: int, ep_rank: int = 0) -> list[int]:
        return [self.rank_of(t, stage, kvp_group, ep_rank) for t in range(self.tp)]

    def kvp_group_ranks(self, tp_rank: int, stage: int, ep_rank: int = 0) -> list[int]:
        """The ranks that hold the same layers and heads in every KVP group (they merge)."""
        return [self.rank_of(tp_rank, stage, g, ep_rank) for g in range(self.kvp)]

    def ep_group_ranks(self, tp_rank: int, stage: int, kvp_group: int) -> list[int]:
        """The ranks that split one stage's experts between them (same TP slice)."""
        return [self.rank_of(tp_rank, stage, kvp_group, e) for e in range(self.ep)]

    @property
    def sampler_rank(self) -> int:
        """The one rank that samples and answers the controller: last stage, TP 0, group 0."""
        return self.rank_of(0, self.spp - 1, 0)


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp_rank: int
    stage: int
    kvp_group: int
    ep_rank: int = 0
