"""Attention for a padded batch of fresh prefills: static shapes, no host synchronisation, so
the whole forward can be captured in a CUDA graph.

Data flow (one instance per (length, batch) bucket, bound to that bucket's static buffers)::

    ShortPrefillExecutor fills slot_mapping [batch * length] (real slots; padding -> scratch)
    for each layer:
        write_kv(...)  index_copy_ of every token's key/value into its slot (padding lands in
                       the reserved scratch block, which the block manager never hands out)
        run(query, ...) keys/values read back from those slots as [batch, kv_heads, length,
                       dim]; one causal SDPA over the padded rows

Why causal alone masks the padding: every row is one prompt at positions ``0..n-1`` followed by
padding, so a real query at position ``i < n`` only sees keys ``0..i``, all real. Padded
queries see garbage, and their outputs are never read (only each row's last real token is
gathered for logits). Every row has at least its own key visible, so nothing is NaN.

Nothing here branches on tensor values or calls ``.item()``; the same object runs eagerly on
CPU and inside ``torch.cuda.graph`` capture on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.kernels.attention import AttentionMetadata, AttentionResult


class PaddedPrefillAttention:
    name = "padded-prefill"

    def __init__(self, slot_mapping: torch.Tensor, batch_size: int, length_tokens: int) -> None:
        if slot_mapping.shape != (batch_size * length_tokens,):
            raise ValueError(f"slot_mapping must have shape ({batch_size * length_tokens},), "
                             f"got {tuple(slot_mapping.shape)}")
        self.slot_mapping = slot_mapping  # a view of a persistent buffer: its address is fixed
        self.batch_size = batch_size
        self.length_tokens = length_tokens

    def plan(self, metadata: AttentionMetadata | None = None) -> None:
        """Nothing to plan: the step's inputs are already in the bound static buffers."""

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        # Unlike the paged reference, no slot is skipped: padding writes to the scratch block,
        # which keeps the shape static (no boolean filtering).
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, self.slot_mapping,
                                                         key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, self.slot_mapping,
                                                         value.to(v_cache.dtype))

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        if return_lse:
            raise ValueError("the padded prefill path serves one process without KV shards; "
                             "it does not compute the log-sum-exp")
        if logit_softcap is not None or (sliding_window is not None
                                         and sliding_window < self.length_tokens):
            raise ValueError("the padded short-prefill path has no soft-capping or sliding "
                             "window shorter than its bucket; serve this model without "
                             "short_prefill_graphs")
        num_tokens, num_heads, head_dim = query.shape
        batch, length = self.batch_size, self.length_tokens
        kv_heads = k_cache.shape[2]
        rows = self.slot_mapping.view(batch, length)
        # [batch, length, heads, dim] -> [batch, heads, length, dim]
        keys = k_cache.view(-1, kv_heads, head_dim)[rows].transpose(1, 2)
        values = v_cache.view(-1, kv_heads, head_dim)[rows].transpose(1, 2)
        queries = query.view(batch, length, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys.to(query.dtype),
                                             values.to(query.dtype), is_causal=True,
                                             scale=scale, enable_gqa=True)
        return AttentionResult(output=out.transpose(1, 2).reshape(num_tokens, num_heads,
                                                                  head_dim),
                               lse_natural=None)
