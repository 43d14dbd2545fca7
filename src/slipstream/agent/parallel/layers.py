"""Megatron-style tensor-parallel layers. Each owns its communication, so a model built from
them (through ``TensorParallelLayers``, a ``LayerFactory``) needs no sharding code.

    column-parallel (q/k/v, gate/up): weight split by output rows; no communication
    row-parallel (o, down):           weight split by input columns; all-reduce the output
    vocab-parallel embedding:         each rank embeds ids in its vocab slice; all-reduce
    vocab-parallel LM head:           each rank scores its vocab slice; all-gather the logits

    experts (models/moe.py):          under TP each expert split like gate/up + down; under EP
                                      each rank holds num_experts / ep whole experts; the
                                      routed output is all-reduced over TP, then over EP

A column-parallel layer followed by a row-parallel one needs exactly one all-reduce per pair.
Each layer cuts its own slice from a full checkpoint tensor (``shard_tensor``), which is how
the loader stays unaware of sharding rules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.agent.engine.models.layers import ExpertShard
from slipstream.agent.parallel.groups import ProcessGroups


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by the TP degree ({parts})")
    return total // parts


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        local_out = _split(out_features, tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out)) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)

    def shard_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp_size, dim=0)[self.tp_rank]


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int,
                 tp_size: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.weight = nn.Parameter(torch.empty(out_features,
                                               _split(in_features, tp_size, "input features")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        partial = F.linear(hidden, self.weight)
        if self.group is not None:
            dist.all_reduce(partial, group=self.group)
        # The bias is added once, after the sum, not once per rank.
        return partial + self.bias if self.bias is not None else partial

    def shard_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp_size, dim=1)[self.tp_rank] if name == "weight" else full


class _VocabSlice(nn.Module):
    """A ``[vocab / tp, hidden]`` slice of a vocabulary matrix, padded when not divisible."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.rows_per_rank = -(-vocab_size // tp_size)
        self.first_row = tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))

    def shard_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        part = full[self.first_row:self.first_row + self.rows_per_rank]
        if part.shape[0] < self.rows_per_rank:
            part = torch.cat([part, part.new_zeros(self.rows_per_rank - part.shape[0],
                                                   *part.shape[1:])])
        return part


class VocabParallelEmbedding(_VocabSlice):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int, tp_size: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__(vocab_size, hidden_size, tp_rank, tp_size)
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_row
        outside = (local_ids < 0) | (local_ids >= self.rows_per_rank)
        embedded = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.group is not None:
            dist.all_reduce(embedded, group=self.group)
        return embedded


class VocabParallelLMHead(_VocabSlice):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int, tp_size: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__(vocab_size, hidden_size, tp_rank, tp_size)
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local_logits = F.linear(hidden, self.weight).contiguous()
        if self.group is None:
            return local_logits[:, :self.vocab_size]
        parts = [torch.empty_like(local_logits) for _ in range(self.tp_size)]
        dist.all_gather(parts, local_logits, group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


class TensorParallelLayers:
    """The ``LayerFactory`` for one rank of a TP group (of size 1 under expert parallelism
    alone) and of its EP group."""

    def __init__(self, groups: ProcessGroups) -> None:
        self.tp_rank, self.tp_size, self.group = groups.tp_rank, groups.tp_size, groups.tp_group
        self.ep_rank, self.ep_size, self.ep_group = groups.ep_rank, groups.ep_size, \
            groups.ep_group

    def embedding(self, vocab_size: int, hidden_size: int) -> nn.Module:
        return VocabParallelEmbedding(vocab_size, hidden_size, self.tp_rank, self.tp_size,
                                      self.group)

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, bias, self.tp_rank, self.tp_size)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return RowParallelLinear(in_features, out_features, bias, self.tp_rank, self.tp_size,
                                 self.group)

    def lm_head(self, hidden_size: int, vocab_size: int) -> nn.Module:
        return VocabParallelLMHead(vocab_size, hidden_size, self.tp_rank, self.tp_size,
                                   self.group)

    def local_count(self, total: int) -> int:
        return _split(total, self.tp_size, "attention heads and KV heads")

    def expert_shard(self, num_experts: int) -> ExpertShard:
        num_local = _split(num_experts, self.ep_size, "experts")
        groups = [group for group in (self.group, self.ep_group) if group is not None]

        def reduce(partial: torch.Tensor) -> None:
            # Expert parallelism without data-parallel attention: every EP rank already holds
            # every token (attention is replicated), so dispatch needs no all-to-all; each
            # rank runs its experts on the tokens routed to them and one all-reduce (a
            # reduce-scatter plus an all-gather) combines the partial sums.
            for group in groups:
                dist.all_reduce(partial, group=group)

        return ExpertShard(first_expert=self.ep_rank * num_local, num_local=num_local,
                           tp_rank=self.tp_rank, tp_size=self.tp_size,
                           reduce=reduce if groups else None)
