"""The attention backend interface, shared by the torch reference (CPU) and FlashInfer (GPU).

Data flow per engine step::

    model runner: Batch -> AttentionMetadata (plain tensors, built once)
    backend.plan(metadata)                     once per step
    for each layer:
        backend.write_kv(k_cache, v_cache, key, value)   store this step's new tokens
        backend.run(query, k_cache, v_cache) -> AttentionResult(output, lse_natural)

The KV cache of one layer is two tensors of shape ``[num_blocks, block_size, kv_heads,
head_dim]`` (the "NHD" paged layout). Sequences are listed decodes first: the first
``num_decodes`` have exactly one query token each.

Log-sum-exp values cross our API in natural-log units (``lse_natural``). FlashInfer returns
base-2 values; its adapter converts, so no caller ever has to guess the base.

For KV-cache parallelism a backend may see only a shard of a sequence's KV. ``kv_start_pos``
gives the absolute position of the shard's first token, so causal masking stays correct, and
the partial results of several shards are combined with :func:`merge_states`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a backend needs about one step's sequences. Built once, used by every layer."""

    query_lens: tuple[int, ...]  # new tokens per sequence
    kv_lens: tuple[int, ...]  # KV tokens each sequence attends to in this shard (cached + new)
    query_start_pos: tuple[int, ...]  # absolute position of each sequence's first query token
    kv_start_pos: tuple[int, ...]  # absolute position of each shard's first KV token (KVP)
    num_decodes: int  # the first num_decodes sequences have one query token each
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64; slot = block * block_size + offset; -1 = skip
    block_size: int
    # Tokens whose slot is -1, counted on the host when the metadata is built, so a backend
    # learns whether it must filter its writes without reading the tensor (a device sync).
    # None: not counted; a backend then checks ``slot_mapping`` itself.
    skipped_writes: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @classmethod
    def build(cls, query_lens: list[int], kv_lens: list[int], query_start_pos: list[int],
              block_tables: list[list[int]], slot_mapping: list[int], block_size: int,
              device: torch.device | str = "cpu", kv_start_pos: list[int] | None = None,
              ) -> AttentionMetadata:
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        max_blocks = max((len(table) for table in block_tables), default=0)
        padded = [list(table) + [0] * (max_blocks - len(table)) for table in block_tables]
        return cls(
            query_lens=tuple(query_lens),
            kv_lens=tuple(kv_lens),
            query_start_pos=tuple(query_start_pos),
            kv_start_pos=tuple(kv_start_pos or [0] * len(query_lens)),
            num_decodes=num_decodes,
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device).reshape(
                len(block_tables), max_blocks),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_size=block_size,
            skipped_writes=sum(1 for slot in slot_mapping if slot < 0),
        )


@dataclass(frozen=True)
class AttentionResult:
    output: torch.Tensor  # [num_tokens, num_heads, head_dim]
    # [num_tokens, num_heads], float32, natural log; -inf where no KV is visible. None when
    # the caller did not ask for it (only KV-sharded attention needs it, to merge partials).
    lse_natural: torch.Tensor | None


class AttentionBackend(Protocol):
    name: str

    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare for one step (index math shared by every layer). Called once per step."""

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's new keys/values ``[num_tokens, kv_heads, head_dim]`` in the cache."""

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True) -> AttentionResult:
        """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the cache."""


def merge_states(output_a: torch.Tensor, lse_natural_a: torch.Tensor,
                 output_b: torch.Tensor, lse_natural_b: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention computed over two disjoint KV sets into attention over their union.

    Each partial output is a softmax-weighted mean over its own KV set; weighting each by its
    share of the total softmax mass, ``exp(lse_x - lse_total)``, gives the exact result. A set
    with no visible KV has ``lse = -inf`` and weight zero.
    """
    lse_a = lse_natural_a.float()
    lse_b = lse_natural_b.float()
    lse_max = torch.maximum(lse_a, lse_b)
    # Where both are -inf, keep the arithmetic finite; the weights below are then both zero.
    lse_max = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)
    weight_a = torch.exp(lse_a - lse_max)
    weight_b = torch.exp(lse_b - lse_max)
    total = weight_a + weight_b
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    merged = (output_a.float() * (weight_a / safe_total).unsqueeze(-1)
              + output_b.float() * (weight_b / safe_total).unsqueeze(-1))
    lse = torch.where(total > 0, lse_max + torch.log(safe_total),
                      torch.full_like(total, float("-inf")))
    return merged.to(output_a.dtype), lse


def merge_many(results: list[AttentionResult]) -> AttentionResult:
    """Fold :func:`merge_states` over any number of KV shards."""
    if not results:
        raise ValueError("merge_many needs at least one partial result")
    parts = [(part.output, part.lse_natural) for part in results]
    lses = [lse for _, lse in parts if lse is not None]
    if len(lses) < len(parts):
        raise ValueError("merging partial attention needs each part's lse (return_lse=True)")
    output, lse = parts[0][0], lses[0]
    for (part_output, _), part_lse in zip(parts[1:], lses[1:]):
        output, lse = merge_states(output, lse, part_output, part_lse)
    return AttentionResult(output=output, lse_natural=lse)


def select_backend(device: torch.device | str, prefer: str = "auto") -> AttentionBackend:
    """FlashInfer when on CUDA and installed (or asked for), else the torch reference."""
    from slipstream.kernels.torch_ref import TorchReferenceBackend

    device = torch.device(device)
    if prefer == "torch" or device.type != "cuda":
        return TorchReferenceBackend()
    # The adapter module imports without flashinfer; constructing the backend is what needs it.
    try:
        from slipstream.kernels.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    except ImportError:
        if prefer == "flashinfer":
            raise
        return TorchReferenceBackend()
