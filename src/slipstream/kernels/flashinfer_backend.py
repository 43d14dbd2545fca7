"""FlashInfer paged attention on CUDA, behind the same protocol as the torch reference.

Data flow per engine step::

    plan(metadata)     -> flashinfer_plan.plan_launches: CSR page tables for up to three
                          launches (decodes, causal prefill, prefill over whole shards)
    write_kv(...)      -> index_copy_ of the new keys/values into their slots, per layer
    run(query, ...)    -> first call of the step: wrapper.plan(...) for each launch;
                          every call: wrapper.run(..., return_lse=True) per launch,
                          base-2 LSE converted to natural log

FlashInfer's ``plan()`` needs head counts, head size, dtypes and the softmax scale, which our
``plan(metadata)`` does not receive. They are known at the first ``run()`` of the step, so the
wrappers are planned there, once, and every later layer with the same shapes reuses the plan.

``flashinfer`` is imported inside the class, so this module imports on machines without it;
constructing the backend then raises ImportError and ``select_backend`` falls back to torch.
Only FlashInfer's fp16/bf16 kernels exist: other dtypes raise TypeError (use the torch backend).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slipstream.kernels.attention import AttentionMetadata, AttentionResult
from slipstream.kernels.flashinfer_plan import PagedLaunch, StepLaunches, plan_launches

# FlashInfer reports log-sum-exp in base 2; ln(x) = log2(x) * ln 2.
LN_2 = math.log(2.0)
LOG2_E = 1.0 / LN_2
KV_LAYOUT = "NHD"  # [num_blocks, block_size, kv_heads, head_dim], as our caches are laid out
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-KV scratch size
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# CUDA-core decode kernels cover small GQA groups; larger groups run faster (and are only
# guaranteed to be compiled) on the tensor-core path.
MAX_GROUP_FOR_CUDA_CORE_DECODE = 4

_MISSING = ("FlashInfer is not installed: install `flashinfer-python` (the `gpu` extra) or use "
            "the torch attention backend")


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as error:
        raise ImportError(f"{_MISSING} ({error})") from error
    return flashinfer


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device | str,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self._flashinfer = _import_flashinfer()
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInfer runs on CUDA devices only, got {self.device}")
        # Shared scratch for every wrapper: their kernels run one after another on one stream.
        # The decode wrapper asks for a zeroed buffer on first use.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper
        self._prefill_causal = prefill(self._workspace, KV_LAYOUT)
        self._prefill_full = prefill(self._workspace, KV_LAYOUT)
        self._decode_by_tensor_cores: dict[bool, Any] = {}
        self._metadata: AttentionMetadata | None = None
        self._launches: StepLaunches | None = None
        self._write_slots: torch.Tensor | None = None
        self._write_rows: torch.Tensor | None = None  # None: every new token is written
        self._planned_for: tuple | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        self._metadata = metadata
        self._launches = plan_launches(metadata)
        self._planned_for = None  # FlashInfer's own plan happens at the step's first run()
        slots = metadata.slot_mapping.to(self.device)
        keep = slots >= 0
        # One host sync per step (not per layer) to learn whether any token skips the write.
        if bool(keep.all()):
            self._write_slots, self._write_rows = slots, None
        else:
            self._write_rows = keep.nonzero().squeeze(1)
            self._write_slots = slots[self._write_rows]

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        self._require_plan()
        if self._write_rows is not None:
            key, value = key[self._write_rows], value[self._write_rows]
        slots = self._write_slots
        assert slots is not None, "plan() sets the write slots"
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        # FlashInfer computes the LSE alongside the output at no real cost, so it is always
        # returned; ``return_lse`` exists for interface parity with the torch backend.
        launches = self._require_plan()
        self._plan_wrappers(query, k_cache, scale, sliding_window, logit_softcap)
        num_tokens, num_heads, head_dim = query.shape
        parts: list[tuple[PagedLaunch, torch.Tensor, torch.Tensor]] = []
        for launch, wrapper in self._wrappers(launches, query.shape[1] // k_cache.shape[2]):
            out, lse_base2 = wrapper.run(query[launch.rows].contiguous(), (k_cache, v_cache),
                                         return_lse=True)
            parts.append((launch, out, lse_base2))

        if len(parts) == 1 and _covers_all(parts[0][0], num_tokens):
            _, out, lse_base2 = parts[0]
            return AttentionResult(output=out, lse_natural=lse_base2 * LN_2)
        if launches.rows_without_kv:
            output = query.new_zeros(num_tokens, num_heads, head_dim)
            lse_natural = torch.full((num_tokens, num_heads), float("-inf"),
                                     dtype=torch.float32, device=query.device)
        else:
            output = query.new_empty(num_tokens, num_heads, head_dim)
            lse_natural = query.new_empty(num_tokens, num_heads, dtype=torch.float32)
        for launch, out, lse_base2 in parts:
            output[launch.rows] = out
            lse_natural[launch.rows] = lse_base2 * LN_2
        return AttentionResult(output=output, lse_natural=lse_natural)

    def _plan_wrappers(self, query: torch.Tensor, k_cache: torch.Tensor, scale: float,
                       sliding_window: int | None = None,
                       logit_softcap: float | None = None) -> None:
        """FlashInfer's plan(), once per step and layer shape (it copies index data to the GPU).
        Layers that alternate windows (Gemma) plan again at each change: correct, not fast.
        The window and soft-cap arguments are untested here (no FlashInfer on the CI machine).
        """
        launches = self._require_plan()
        metadata = self._metadata
        assert metadata is not None  # set together with the launches
        if query.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"FlashInfer attention supports float16/bfloat16, got {query.dtype}; "
                            "use the torch backend for other dtypes")
        if k_cache.shape[1] != metadata.block_size:
            raise ValueError(f"cache block size {k_cache.shape[1]} != metadata block size "
                             f"{metadata.block_size}")
        num_heads, head_dim = query.shape[1], query.shape[2]
        kv_heads = k_cache.shape[2]
        key = (num_heads, kv_heads, head_dim, query.dtype, k_cache.dtype, float(scale),
               sliding_window, logit_softcap)
        if key == self._planned_for:
            return
        shapes = (num_heads, kv_heads, head_dim, metadata.block_size)
        dtypes = {"q_data_type": query.dtype, "kv_data_type": k_cache.dtype,
                  # FlashInfer's window_left counts the keys before the query's own.
                  "window_left": -1 if sliding_window is None else sliding_window - 1,
                  "logits_soft_cap": logit_softcap or 0.0}
        for launch, wrapper in self._wrappers(launches, num_heads // kv_heads):
            if launch is launches.decode:
                wrapper.plan(launch.kv_indptr, launch.kv_indices, launch.kv_last_page_len,
                             *shapes, pos_encoding_mode="NONE", sm_scale=scale, **dtypes)
            else:
                wrapper.plan(launch.qo_indptr, launch.kv_indptr, launch.kv_indices,
                             launch.kv_last_page_len, *shapes, causal=launch.causal,
                             pos_encoding_mode="NONE", sm_scale=scale, **dtypes)
        self._planned_for = key

    def _wrappers(self, launches: StepLaunches, group_size: int) -> list[tuple[PagedLaunch, Any]]:
        pairs = []
        if launches.decode is not None:
            pairs.append((launches.decode, self._decode_wrapper(group_size)))
        if launches.prefill_causal is not None:
            pairs.append((launches.prefill_causal, self._prefill_causal))
        if launches.prefill_full is not None:
            pairs.append((launches.prefill_full, self._prefill_full))
        return pairs

    def _decode_wrapper(self, group_size: int) -> Any:
        tensor_cores = group_size > MAX_GROUP_FOR_CUDA_CORE_DECODE
        if tensor_cores not in self._decode_by_tensor_cores:
            self._decode_by_tensor_cores[tensor_cores] = (
                self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, KV_LAYOUT, use_tensor_cores=tensor_cores))
        return self._decode_by_tensor_cores[tensor_cores]

    def _require_plan(self) -> StepLaunches:
        if self._launches is None:
            raise RuntimeError("plan() must be called once per step before write_kv()/run()")
        return self._launches


def _covers_all(launch: PagedLaunch, num_tokens: int) -> bool:
    """True when one launch computed every row in order, so its tensors are the result."""
    return isinstance(launch.rows, slice) and launch.rows == slice(0, num_tokens)


def merge_states_gpu(output_a: torch.Tensor, lse_natural_a: torch.Tensor,
                     output_b: torch.Tensor, lse_natural_b: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`slipstream.kernels.attention.merge_states` as one FlashInfer kernel (fp16/bf16).

    Takes and returns natural-log LSE; FlashInfer's kernel works in base 2.
    """
    flashinfer = _import_flashinfer()
    if output_a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"flashinfer.merge_state supports float16/bfloat16, got {output_a.dtype}")
    lse_base2_a = lse_natural_a.float() * LOG2_E
    lse_base2_b = lse_natural_b.float() * LOG2_E
    merged, lse_base2 = flashinfer.merge_state(output_a.contiguous(), lse_base2_a.contiguous(),
                                               output_b.contiguous(), lse_base2_b.contiguous())
    # Two empty sets give (-inf) - (-inf) = NaN in older FlashInfer kernels; the spec says
    # zero output and lse = -inf.
    both_empty = torch.isneginf(lse_natural_a) & torch.isneginf(lse_natural_b)
    merged = torch.where(both_empty.unsqueeze(-1), torch.zeros_like(merged), merged)
    lse_natural = torch.where(both_empty, torch.full_like(lse_base2, float("-inf")),
                              lse_base2 * LN_2)
    return merged, lse_natural
