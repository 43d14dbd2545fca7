"""CPU matmuls on weights that oneDNN has reordered once, at load.

``F.linear`` on a CPU hands each call to a GEMM that reads the weight in its stored row-major
layout. oneDNN (bundled with PyTorch, the library behind ``torch.ops.mkldnn``) can instead
reorder a weight once into the blocked layout its kernels stream through, and then multiply
straight from it. For the thin matmuls of a serving step the difference is large. Measured on
the 2-core development machine (AMD EPYC with AVX-512, two threads, float32, SmolLM2-135M's
shapes; milliseconds per call, row-major ``F.linear`` against the reordered weight):

    rows x (out, in)          F.linear  reordered
    32 x (3072, 576)             0.95      0.56     gate/up of 32 decodes
    32 x (49152, 576)           26.5      10.1      the LM head of 32 decodes
    1 x (49152, 576)            11.6       4.6      the LM head of one decode
    2048 x (3072, 576)          49.2      34.6      gate/up of a 2,048-token prefill

It changes which kernel sums the products, not what is summed: outputs match ``F.linear`` to
float32 rounding (``pack_cpu_matmuls`` checks one layer before it commits). The reordered
weights replace the dense ones in the serving model; the model's ``state_dict`` then holds only
what the forward still reads (norms, the embedding). Used for float32 on CPU (``--cpu-matmul``;
``auto`` picks it when this PyTorch has oneDNN), in one process and in pipeline or KV-parallel
workers; never under tensor parallelism, whose layers bring their own matmuls and
communication.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

CPU_MATMULS = ("auto", "onednn", "torch")

# oneDNN picks its blocking for an expected row count; 32 (a decode batch) was fastest for 1 to
# 2,048 rows on every SmolLM2 shape measured above, ahead of a reorder for 1 row.
REORDER_FOR_ROWS = 32


def onednn_available() -> bool:
    """Whether this PyTorch build can reorder and multiply linear weights with oneDNN."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def resolve_cpu_matmul(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """``onednn`` or ``torch`` for a model on ``device`` in ``dtype``. ``auto`` takes oneDNN
    for float32 on CPU when it is there; asking for ``onednn`` where it cannot run is an
    error, not a silent fallback."""
    if choice not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul must be one of {', '.join(CPU_MATMULS)}, got {choice!r}")
    eligible = device.type == "cpu" and dtype == torch.float32
    if choice == "torch" or (choice == "auto" and not eligible):
        return "torch"
    if not eligible:
        raise ValueError(f"cpu_matmul onednn needs float32 on CPU, not {dtype} on {device.type}")
    if not onednn_available():
        if choice == "onednn":
            raise ValueError("cpu_matmul onednn: this PyTorch build has no oneDNN (mkldnn)")
        return "torch"
    return "onednn"


class ReorderedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` with ``weight`` [out, in] reordered once by oneDNN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.reordered = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().contiguous(), REORDER_FOR_ROWS)
        # Plain attributes, not parameters or buffers: the state_dict stays the checkpoint's.
        self.bias_values = None if bias is None else bias.detach().contiguous()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.reordered, self.bias_values,
                                                 "none", [], "")
        return out.view(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_values is not None}, oneDNN reordered")


def _plain(module: nn.Module | None) -> bool:
    return type(module) is nn.Linear


def _reordered(linear: nn.Module) -> ReorderedLinear:
    plain = cast(nn.Linear, linear)
    return ReorderedLinear(plain.weight, plain.bias)


def _drop(owner: nn.Module, *names: str) -> None:
    """Release submodules whose dense weights a reordered copy replaced (their slots stay, as
    None, so the module's structure still reads like the checkpoint's)."""
    for name in names:
        setattr(owner, name, None)


def _matches(reordered: ReorderedLinear, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    probe = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = F.linear(probe, weight, bias)
        return bool(torch.allclose(reordered(probe), expected, rtol=1e-4, atol=1e-4))


def pack_cpu_matmuls(model: nn.Module) -> int:
    """Reorder the projections and LM head of a float32 CPU Llama-family ``model`` for oneDNN
    and drop their dense copies; returns how many matmuls now run from reordered weights (0,
    with a warning, if oneDNN's output disagrees with ``F.linear`` on the first one).

    Each decoder layer's fused q/k/v and gate/up weights (``fuse_projections``), its o and
    down projections, and the LM head. A tied LM head keeps the embedding's dense weight for
    token lookups and gets its own reordered copy (one vocabulary matrix more in memory).
    """
    from slipstream.agent.engine.models.llama import (LlamaDecoderLayer, LlamaForCausalLM,
                                                       LlamaMLP)

    model = cast(LlamaForCausalLM, model)
    layers = cast(list[LlamaDecoderLayer], list(model.model.layers.values()))
    first = layers[0].mlp if layers else None
    if isinstance(first, LlamaMLP) and first.gate_up_weight is not None:
        try:
            agrees = _matches(ReorderedLinear(first.gate_up_weight), first.gate_up_weight, None)
        except (RuntimeError, TypeError) as error:  # a PyTorch whose private ops changed
            log.warning("oneDNN's matmul failed on this machine (%s: %s); keeping torch's",
                        type(error).__name__, error)
            return 0
        if not agrees:
            log.warning("oneDNN's matmul disagrees with torch's on this machine; keeping "
                        "torch's (--cpu-matmul torch)")
            return 0
    packed = 0
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_weight is not None:
            attn.qkv_fused = ReorderedLinear(attn.qkv_weight, attn.qkv_bias)
            attn.qkv_weight = attn.qkv_bias = None
            _drop(attn, "q_proj", "k_proj", "v_proj")
            packed += 1
        if _plain(attn.o_proj):
            attn.o_proj = _reordered(attn.o_proj)
            packed += 1
        if not isinstance(mlp, LlamaMLP):  # a mixture of experts keeps its expert tensors
            continue
        if mlp.gate_up_weight is not None:
            mlp.gate_up_fused = ReorderedLinear(mlp.gate_up_weight)
            mlp.gate_up_weight = None
            _drop(mlp, "gate_proj", "up_proj")
            packed += 1
        if _plain(mlp.down_proj):
            mlp.down_proj = _reordered(mlp.down_proj)
            packed += 1
    if _plain(model.lm_head):
        model.lm_head = _reordered(cast(nn.Module, model.lm_head))
        packed += 1
    return packed


def apply_cpu_matmul(model: nn.Module, choice: str, device: torch.device,
                     dtype: torch.dtype) -> str:
    """Resolve ``choice`` (``--cpu-matmul``) for this model and reorder its weights when that
    is oneDNN; returns the path the model runs on (``torch`` if packing declined)."""
    resolved = resolve_cpu_matmul(choice, device, dtype)
    if resolved == "onednn" and not pack_cpu_matmuls(model):
        return "torch"
    return resolved
