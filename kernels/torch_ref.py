"""Paged attention in plain torch: the CPU backend and the reference the GPU backend is tested
against.

``plan`` turns block tables into flat slot indices and causal masks once per step; every
layer then gathers its keys/values with one indexing op. Decodes (one query token each) are
computed together, padded to the longest KV; prefill chunks are computed one sequence at a
time, each causal over its cached tokens plus its new ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.kernels.attention import AttentionMetadata, AttentionResult


@dataclass(frozen=True)
class _GatherPlan:
    slots: torch.Tensor  # [rows, kv_len] or [kv_len]: flat cache slots to read
    mask: torch.Tensor  # True where the query may attend: [rows, 1, kv_len] or [q, kv_len]
    token_start: int  # first query row in the flat token dimension
    token_end: int


def _slots(block_table: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    offsets = torch.arange(kv_len, device=block_table.device)
    return block_table[..., offsets // block_size] * block_size + offsets % block_size


class TorchReferenceBackend:
    name = "torch"

    def __init__(self) -> None:
        self._metadata: AttentionMetadata | None = None
        self._decode: _GatherPlan | None = None
        self._prefills: list[_GatherPlan] = []

    def plan(self, metadata: AttentionMetadata) -> None:
        self._metadata = metadata
        device = metadata.block_tables.device
        self._decode = None
        self._prefills = []
        num_decodes = metadata.num_decodes
        if num_decodes:
            max_kv = max(metadata.kv_lens[:num_decodes])
            slots = _slots(metadata.block_tables[:num_decodes], max_kv, metadata.block_size)
            kv_index = torch.arange(max_kv, device=device)
            kv_lens = torch.tensor(metadata.kv_lens[:num_decodes], device=device)
            kv_start = torch.tensor(metadata.kv_start_pos[:num_decodes], device=device)
            query_pos = torch.tensor(metadata.query_start_pos[:num_decodes], device=device)
            mask = (kv_index[None, :] < kv_lens[:, None]) & (
                kv_start[:, None] + kv_index[None, :] <= query_pos[:, None])
            self._decode = _GatherPlan(slots, mask[:, None, None, None, :], 0, num_decodes)
        token = num_decodes
        for seq in range(num_decodes, metadata.num_seqs):
            query_len, kv_len = metadata.query_lens[seq], metadata.kv_lens[seq]
            slots = _slots(metadata.block_tables[seq], kv_len, metadata.block_size)
            query_pos = metadata.query_start_pos[seq] + torch.arange(query_len, device=device)
            kv_pos = metadata.kv_start_pos[seq] + torch.arange(kv_len, device=device)
            mask = kv_pos[None, :] <= query_pos[:, None]
            self._prefills.append(_GatherPlan(slots, mask, token, token + query_len))
            token += query_len

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        slots = self._require_plan().slot_mapping
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float) -> AttentionResult:
        self._require_plan()
        num_tokens, num_heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        group = num_heads // kv_heads
        k_flat = k_cache.view(-1, kv_heads, head_dim)
        v_flat = v_cache.view(-1, kv_heads, head_dim)
        output = torch.empty_like(query)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=query.device)

        if self._decode is not None:
            plan = self._decode
            rows = plan.token_end - plan.token_start
            # [rows, kv_heads, group, 1, dim] x [rows, kv_heads, 1, dim, kv] -> scores per head
            q = query[plan.token_start:plan.token_end].view(rows, kv_heads, group, 1, head_dim)
            keys = k_flat[plan.slots].permute(0, 2, 3, 1).unsqueeze(2)
            values = v_flat[plan.slots].permute(0, 2, 1, 3).unsqueeze(2)
            out, row_lse = _masked_softmax_attend(q, keys, values, plan.mask, scale)
            output[plan.token_start:plan.token_end] = out.reshape(rows, num_heads, head_dim)
            lse[plan.token_start:plan.token_end] = row_lse.reshape(rows, num_heads)

        for plan in self._prefills:
            q_len = plan.token_end - plan.token_start
            # [kv_heads, group*q, dim] x [kv_heads, dim, kv]
            q = query[plan.token_start:plan.token_end].view(q_len, kv_heads, group, head_dim)
            q = q.permute(1, 2, 0, 3)  # [kv_heads, group, q, dim]
            keys = k_flat[plan.slots].permute(1, 2, 0).unsqueeze(1)  # [kv_heads, 1, dim, kv]
            values = v_flat[plan.slots].permute(1, 0, 2).unsqueeze(1)  # [kv_heads, 1, kv, dim]
            out, row_lse = _masked_softmax_attend(q, keys, values, plan.mask, scale)
            output[plan.token_start:plan.token_end] = out.permute(2, 0, 1, 3).reshape(
                q_len, num_heads, head_dim)
            lse[plan.token_start:plan.token_end] = row_lse.permute(2, 0, 1).reshape(
                q_len, num_heads)
        return AttentionResult(output=output, lse_natural=lse)

    def _require_plan(self) -> AttentionMetadata:
        if self._metadata is None:
            raise RuntimeError("plan() must be called once per step before write_kv()/run()")
        return self._metadata


def _masked_softmax_attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale, masked) v, plus the natural log-sum-exp of the masked scores."""
    scores = torch.matmul(query.float(), keys.float()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # Rows with nothing visible have lse = -inf; give them zero output instead of NaN.
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - finite_lse.unsqueeze(-1))
    out = torch.matmul(probs, values.float())
    return out.to(query.dtype), lse
