"""The attention backend over our Triton kernels (``triton_attention.py``): the default on
CUDA when FlashInfer is not installed.

    AttentionMetadata (its seq_info and block_indices already on the device, one copy)
    plan()     split the sequences into decodes and prefills (views, no copy, no sync)
    write_kv() one kernel for the step's new keys and values
    run()      decode kernels for the first ``num_decodes`` rows, the prefill kernel for the
               rest; every launch size comes from host values, so nothing waits for the GPU

On a CPU the same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``): slow, but
the very code the GPU runs, checked against the torch reference in CI.
"""

from __future__ import annotations

import os

import torch

from slipstream.kernels.attention import AttentionMetadata, AttentionResult
from slipstream.kernels.triton_attention import (KernelOptions, decode_segments, paged_decode,
                                                 write_kv)
from slipstream.kernels.triton_prefill import paged_prefill


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (set before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend:
    name = "triton"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"the triton attention backend runs on CUDA, not {self.device}; on a CPU its "
                "kernels run only under Triton's interpreter (TRITON_INTERPRET=1, for tests): "
                "use --attention-backend torch or auto")
        self._metadata: AttentionMetadata | None = None
        self._seq_info = torch.empty(0, 6, dtype=torch.int64)
        self._block_indices = torch.empty(0, dtype=torch.int64)
        # Decode scratch, allocated once per step on first use and shared by every layer.
        self._partial: tuple[torch.Tensor, torch.Tensor] | None = None
        self._segments = 1

    def plan(self, metadata: AttentionMetadata) -> None:
        if metadata.seq_info is None or metadata.block_indices is None:
            raise ValueError("the triton backend needs AttentionMetadata.build's seq_info "
                             "and block_indices")
        self._metadata = metadata
        # Metadata built for another device (a test, the profiler) moves here once.
        self._seq_info = metadata.seq_info.to(self.device, non_blocking=True)
        self._block_indices = metadata.block_indices.to(self.device, non_blocking=True)
        self._slot_mapping = metadata.slot_mapping.to(self.device, non_blocking=True)
        self._partial = None

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        self._require_plan()
        write_kv(key, value, k_cache, v_cache, self._slot_mapping)

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        metadata = self._require_plan()
        options = KernelOptions.of(sliding_window, logit_softcap)
        num_tokens, num_heads, head_dim = query.shape
        output = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype,
                             device=query.device)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=query.device) \
            if return_lse else None
        num_decodes = metadata.num_decodes
        if num_decodes:
            partial_out, partial_lse = self._decode_scratch(metadata, num_heads, head_dim,
                                                            k_cache.shape[2])
            paged_decode(query, k_cache, v_cache, self._seq_info[:num_decodes],
                         self._block_indices, scale, output, lse, self._segments,
                         partial_out, partial_lse, options)
        if num_decodes < metadata.num_seqs:
            # Decodes are one token each and come first: the prefill tokens start there.
            paged_prefill(query, k_cache, v_cache, self._seq_info[num_decodes:],
                          self._block_indices, scale, output, lse,
                          max(metadata.query_lens[num_decodes:]),
                          longest_kv=max(metadata.kv_lens[num_decodes:]),
                          num_tokens=num_tokens - num_decodes, first_token=num_decodes,
                          options=options, query_lens=metadata.query_lens[num_decodes:])
        return AttentionResult(output=output, lse_natural=lse)

    def _decode_scratch(self, metadata: AttentionMetadata, num_heads: int, head_dim: int,
                        num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._partial is None:
            num_decodes = metadata.num_decodes
            self._segments = decode_segments(num_decodes, num_kv_heads,
                                             max(metadata.kv_lens[:num_decodes]))
            rows = num_decodes * num_heads * self._segments
            self._partial = (
                torch.empty(rows * head_dim, dtype=torch.float32, device=self.device),
                torch.empty(rows, dtype=torch.float32, device=self.device))
        return self._partial

    def _require_plan(self) -> AttentionMetadata:
        if self._metadata is None:
            raise RuntimeError("plan() must be called once per step before write_kv()/run()")
        return self._metadata


class StaticDecodeAttention:
    """Decode attention bound to fixed buffers, for a CUDA graph (``decode_graphs.py``): the
    rows' slots, ``seq_info`` and block indices are rewritten in place before each replay,
    and the segment count is fixed for the graph's batch size. No plan, no host values."""

    name = "triton-static-decode"

    def __init__(self, slot_mapping: torch.Tensor, seq_info: torch.Tensor,
                 block_indices: torch.Tensor, num_segments: int) -> None:
        self.slot_mapping = slot_mapping
        self.seq_info = seq_info
        self.block_indices = block_indices
        self.num_segments = num_segments

    def plan(self, metadata: AttentionMetadata | None = None) -> None:
        """Nothing to plan: the step's rows are already in the bound buffers."""

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        write_kv(key, value, k_cache, v_cache, self.slot_mapping)

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        if return_lse:
            raise ValueError("graph-captured decode serves one process without KV shards; it "
                             "does not compute the log-sum-exp")
        output = torch.empty_like(query, memory_format=torch.contiguous_format)
        paged_decode(query, k_cache, v_cache, self.seq_info, self.block_indices, scale, output,
                     None, self.num_segments,
                     options=KernelOptions.of(sliding_window, logit_softcap))
        return AttentionResult(output=output, lse_natural=None)
