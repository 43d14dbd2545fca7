"""The attention backend interface, shared by the torch reference (CPU), the Triton kernels
(CUDA, no extra wheel) and FlashInfer (CUDA, when installed).

Data flow per engine step::

    model runner: Batch -> AttentionMetadata (host tuples + device tensors, one copy)
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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


# Columns of AttentionMetadata.seq_info, one row per sequence (kernels/triton_attention.py).
TOKEN_START, QUERY_LEN, QUERY_POS, KV_LEN, KV_POS, BLOCK_START = range(6)
SEQ_INFO_COLUMNS = 6


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything a backend needs about one step's sequences. Built once, used by every layer.

    The host tuples describe the step for index math on the host (no synchronisation); the
    tensors live on the cache's device and were moved there in one copy (``build``)."""

    query_lens: tuple[int, ...]  # new tokens per sequence
    kv_lens: tuple[int, ...]  # KV tokens each sequence attends to in this shard (cached + new)
    query_start_pos: tuple[int, ...]  # absolute position of each sequence's first query token
    kv_start_pos: tuple[int, ...]  # absolute position of each shard's first KV token (KVP)
    num_decodes: int  # the first num_decodes sequences have one query token each
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64; slot = block * block_size + offset; -1 = skip
    block_size: int
    # The same sequences for kernels that take flattened block tables (triton_attention.py):
    # [num_seqs, 6] int64 rows (token start, query len, query pos, kv len, kv pos, block
    # start) and every sequence's blocks back to back. None when built without them.
    seq_info: torch.Tensor | None = None
    block_indices: torch.Tensor | None = None
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

    @property
    def longest_query(self) -> int:
        return max(self.query_lens, default=0)

    @classmethod
    def build(cls, query_lens: list[int], kv_lens: list[int], query_start_pos: list[int],
              block_tables: list[list[int]], slot_mapping: list[int], block_size: int,
              device: torch.device | str = "cpu", kv_start_pos: list[int] | None = None,
              ) -> AttentionMetadata:
        return cls.build_with(query_lens, kv_lens, query_start_pos, block_tables,
                              slot_mapping, block_size, device, kv_start_pos)[0]

    @classmethod
    def build_with(cls, query_lens: Sequence[int], kv_lens: Sequence[int],
                   query_start_pos: Sequence[int], block_tables: Sequence[Sequence[int]],
                   slot_mapping: Sequence[int], block_size: int,
                   device: torch.device | str = "cpu",
                   kv_start_pos: Sequence[int] | None = None,
                   extra: Sequence[Sequence[int]] = ()
                   ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """The metadata, plus ``extra`` integer arrays (a runner's token ids, positions)
        moved to ``device`` in the same single host-to-device copy."""
        num_seqs = len(query_lens)
        kv_start = list(kv_start_pos) if kv_start_pos is not None else [0] * num_seqs
        num_decodes = 0
        while num_decodes < num_seqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        max_blocks = max((len(table) for table in block_tables), default=0)
        dense = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for row, table in enumerate(block_tables):
            dense[row, :len(table)] = table
        lengths = np.fromiter((len(table) for table in block_tables), np.int64, num_seqs)
        block_starts = np.zeros(num_seqs, dtype=np.int64)
        np.cumsum(lengths[:-1], out=block_starts[1:])
        token_starts = np.zeros(num_seqs, dtype=np.int64)
        np.cumsum(np.asarray(query_lens[:-1], dtype=np.int64), out=token_starts[1:])
        seq_info = np.stack([token_starts, np.asarray(query_lens, dtype=np.int64),
                             np.asarray(query_start_pos, dtype=np.int64),
                             np.asarray(kv_lens, dtype=np.int64),
                             np.asarray(kv_start, dtype=np.int64), block_starts], axis=1) \
            if num_seqs else np.zeros((0, 6), dtype=np.int64)
        flat_blocks = np.fromiter(itertools.chain.from_iterable(block_tables), np.int64,
                                  int(lengths.sum()))
        slots = np.asarray(slot_mapping, dtype=np.int64)
        moved = to_device_in_one_copy(
            [dense, slots, seq_info, flat_blocks,
             *[np.asarray(array, dtype=np.int64) for array in extra]], device)
        metadata = cls(
            query_lens=tuple(query_lens), kv_lens=tuple(kv_lens),
            query_start_pos=tuple(query_start_pos), kv_start_pos=tuple(kv_start),
            num_decodes=num_decodes, block_tables=moved[0], slot_mapping=moved[1],
            block_size=block_size, seq_info=moved[2], block_indices=moved[3],
            skipped_writes=int((slots < 0).sum()))
        return metadata, moved[4:]


def to_device_in_one_copy(arrays: Sequence[np.ndarray], device: torch.device | str
                          ) -> list[torch.Tensor]:
    """int64 ``arrays`` as tensors on ``device`` (same shapes), views of one buffer filled on
    the host and moved by one copy: pinned and asynchronous on CUDA, so the host never
    waits for the GPU here. On the CPU the views share the host buffer."""
    device = torch.device(device)
    sizes = [int(array.size) for array in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    flat = host.numpy()
    offset = 0
    for array, size in zip(arrays, sizes):
        flat[offset:offset + size] = array.reshape(-1)
        offset += size
    moved = host.to(device, non_blocking=True) if device.type != "cpu" else host
    views = []
    offset = 0
    for array, size in zip(arrays, sizes):
        views.append(moved[offset:offset + size].view(array.shape))
        offset += size
    return views


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
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the cache.

        ``sliding_window``: the query at position ``p`` sees only keys after
        ``p - sliding_window`` (a per-layer option: Mistral, Gemma's local layers).
        ``logit_softcap``: scores become ``cap * tanh(scores / cap)`` before the softmax
        (Gemma 2). A backend that cannot do either raises ValueError saying so."""


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


BACKENDS = ("auto", "torch", "triton", "flashinfer")


def select_backend(device: torch.device | str, prefer: str = "auto") -> AttentionBackend:
    """``auto``: on CUDA, FlashInfer when it is installed, else the Triton kernels; on a CPU
    the torch reference. ``triton`` on a CPU runs under Triton's interpreter, which needs
    ``TRITON_INTERPRET=1`` (tests do this); ValueError otherwise."""
    from slipstream.kernels.torch_ref import TorchReferenceBackend

    if prefer not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {prefer!r}")
    device = torch.device(device)
    if prefer == "torch" or (prefer == "auto" and device.type != "cuda"):
        return TorchReferenceBackend()
    if prefer == "triton":
        return _triton_backend(device)
    if prefer == "flashinfer" and device.type != "cuda":
        raise ValueError(f"the flashinfer attention backend runs on CUDA only, not {device}")
    # The adapter module imports without flashinfer; constructing the backend is what needs it.
    try:
        from slipstream.kernels.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    except ImportError:
        if prefer == "flashinfer":
            raise
        return _triton_backend(device)


def backend_name(device: torch.device | str, prefer: str = "auto") -> str:
    """The name of the backend ``select_backend`` picks, without building it."""
    import importlib.util

    device = torch.device(device)
    if prefer != "auto":
        return prefer
    if device.type != "cuda":
        return "torch"
    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


def _triton_backend(device: torch.device) -> AttentionBackend:
    from slipstream.kernels.triton_backend import TritonBackend

    return TritonBackend(device)
