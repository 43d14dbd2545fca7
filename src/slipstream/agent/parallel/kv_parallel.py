"""KV-cache parallelism (KVP) with progressive scaling, Medha section 3.3.

A request's KV fills KVP group 0 up to ``tokens_per_group`` tokens, then group 1, and so on.
Every KVP group runs every batch (each is a full pipeline); per layer:

    each group: write_kv of the tokens it owns (others get slot -1: only the owner stores)
                partial attention over its own shard, with its log-sum-exp (empty shard: -inf)
    all groups: all-gather (output, lse) -> merge_many, in group order -> identical everywhere

``group_metadata`` cuts a batch down to one group's shard; ``KVParallelBackend`` wraps any
attention backend with the gather-and-merge, so the model sees an ordinary backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from slipstream.agent.scheduler.batch import ScheduledChunk
from slipstream.kernels.attention import (
    AttentionBackend, AttentionMetadata, AttentionResult, merge_many)


def group_metadata(chunks: Sequence[ScheduledChunk], group: int, tokens_per_group: int,
                   block_size: int, device: torch.device) -> AttentionMetadata:
    """Attention metadata for group ``group``'s shard of every sequence in a batch.

    Block ids are global (every group holds the whole block pool), so a token's slot is the
    same in every group; a group simply reads and writes only its own positions.
    """
    shard_start = group * tokens_per_group
    shard_end = shard_start + tokens_per_group
    kv_lens: list[int] = []
    block_tables: list[list[int]] = []
    slots: list[int] = []
    for chunk in chunks:
        kv_len = min(max(chunk.end_pos - shard_start, 0), tokens_per_group)
        first_block = shard_start // block_size
        kv_lens.append(kv_len)
        block_tables.append(list(chunk.block_ids[first_block:first_block + -(-kv_len // block_size)]))
        table = chunk.block_ids
        slots.extend(table[pos // block_size] * block_size + pos % block_size
                     if shard_start <= pos < shard_end else -1
                     for pos in range(chunk.start_pos, chunk.end_pos))
    return AttentionMetadata.build(
        query_lens=[c.num_tokens for c in chunks], kv_lens=kv_lens,
        query_start_pos=[c.start_pos for c in chunks], block_tables=block_tables,
        slot_mapping=slots, block_size=block_size, device=device,
        kv_start_pos=[shard_start] * len(chunks))


class KVParallelBackend:
    """An attention backend over one KVP group's shard that returns attention over all shards."""

    def __init__(self, inner: AttentionBackend, group: dist.ProcessGroup, group_size: int) -> None:
        self.inner = inner
        self.group = group
        self.group_size = group_size
        self.name = f"kvp({inner.name})"

    def plan(self, metadata: AttentionMetadata) -> None:
        self.inner.plan(metadata)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        self.inner.write_kv(k_cache, v_cache, key, value)

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        # Positions are absolute in every shard, so windows mask the same keys as one process.
        part = self.inner.run(query, k_cache, v_cache, scale, return_lse=True,
                              sliding_window=sliding_window, logit_softcap=logit_softcap)
        if part.lse_natural is None:
            raise RuntimeError(f"{self.inner.name} returned no lse; KVP cannot merge without it")
        # One collective per layer: the output and its lse travel as one fp32 tensor.
        packed = torch.cat([part.output.float(), part.lse_natural.unsqueeze(-1)], dim=-1)
        gathered = [torch.empty_like(packed) for _ in range(self.group_size)]
        dist.all_gather(gathered, packed.contiguous(), group=self.group)
        merged = merge_many([AttentionResult(output=p[..., :-1], lse_natural=p[..., -1])
                             for p in gathered])
        return AttentionResult(output=merged.output.to(query.dtype),
                               lse_natural=merged.lse_natural if return_lse else None)
