"""Which weight format each tensor is served in: ``--quantization`` resolved against the model.

    --quantization auto  | a GGUF file                  -> "gguf": its blocks as they are
                         | config.json quantization_config -> "checkpoint": as stored (fp8, AWQ)
                         | a float checkpoint           -> "none"
    --quantization none  -> float (a GGUF is dequantized, as before)
    --quantization int8 | int4 | fp8 -> a float checkpoint quantized at load, weights only

At-load quantization covers every decoder projection. The token embedding and the LM head
become int8 rows for int4 (llama.cpp's Q4 files keep them in Q8_0 too) and stay in the model's
dtype for int8 and fp8 (as vLLM's fp8 does): int8 is the format for quality, and on SmolLM2
int8 rows moved the mean KL against float32 from 0.0079 to 0.0087 on a short text. What cannot be served as asked fails here, at
start-up, with one line saying what to do (``QuantizationError``); nothing falls back to another
precision silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slipstream.agent.engine.models.weight_formats import (Fp8Weight, Int4Weight,
                                                           QuantizedWeight, pack_nibbles, quantize)

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "fp8")
AT_LOAD = ("int8", "int4", "fp8")
DEFAULT_GROUP_SIZE = 64
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_VOCABULARY = ("model.embed_tokens.weight", "lm_head.weight")


class QuantizationError(ValueError):
    """The weights cannot be served in the format asked for; the message says what to do."""


def checkpoint_method(model_dir: Path) -> str | None:
    """``quantization_config.quant_method`` of a Hugging Face checkpoint (None: float)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = raw.get("quantization_config") if isinstance(raw, dict) else None
    if not isinstance(config, dict):
        return None
    return str(config.get("quant_method", "unknown"))


def resolve_quantization(requested: str, model_dir: Path, gguf_file: Path | None) -> str:
    """``none``, ``int8``, ``int4``, ``fp8``, ``gguf`` or ``checkpoint``."""
    if requested not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"--quantization must be one of "
                                f"{', '.join(QUANTIZATION_CHOICES)}, got {requested!r}")
    method = checkpoint_method(model_dir) if gguf_file is None else None
    if gguf_file is not None:
        if requested in AT_LOAD:
            raise QuantizationError(
                f"--quantization {requested}: a GGUF file is served in its own formats "
                "(--quantization auto) or dequantized (none), not quantized again")
        return "gguf" if requested == "auto" else "none"
    if method is not None:
        if requested != "auto":
            raise QuantizationError(
                f"--quantization {requested}: this checkpoint is already quantized "
                f"({method}); serve it as it is with --quantization auto")
        return "checkpoint"
    return "none" if requested == "auto" else requested


def at_load_format(name: str, resolved: str) -> str | None:
    """The format a float checkpoint tensor ``name`` is quantized to at load (None: kept)."""
    if resolved not in AT_LOAD:
        return None
    if name.endswith(".weight") and name.rsplit(".", 2)[-2] in _PROJECTIONS:
        return resolved
    if name in _VOCABULARY and resolved in ("int4",):
        return "int8"
    return None


def quantize_at_load(name: str, tensor: torch.Tensor, resolved: str, group_size: int
                     ) -> QuantizedWeight | torch.Tensor:
    target = at_load_format(name, resolved)
    return tensor if target is None else quantize(tensor, target, group_size)


def describe(resolved: str, model_dir: Path, gguf_file: Path | None, group_size: int) -> str:
    """The weight format in words, for logs and the runtime profile's key."""
    if resolved == "gguf" and gguf_file is not None:
        from slipstream.agent.engine.models.gguf_weights import weight_format_name

        return weight_format_name(gguf_file)
    if resolved == "checkpoint":
        return f"checkpoint:{checkpoint_method(model_dir)}"
    if resolved == "int4":
        return f"int4-g{group_size}"
    return "dense" if resolved == "none" else resolved


# -- checkpoints that are quantized already ---------------------------------------------------

def read_quantized_checkpoint(model_dir: Path, shard: Any, names: list[str]
                              ) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    """The tensors of one safetensors ``shard`` of a quantized checkpoint, under the model's
    parameter names: compressed-tensors or ``fp8`` float8 weights with their scales, AWQ
    (GEMM) int4. Anything else is a QuantizationError naming the method."""
    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    method = config.get("quant_method")
    if method in ("compressed-tensors", "fp8"):
        _check_fp8_config(config)
        yield from _fp8_tensors(shard, names)
    elif method == "awq":
        yield from _awq_tensors(shard, names, config)
    else:
        raise QuantizationError(
            f"checkpoint quantization {method!r} is not supported (Slipstream reads fp8 "
            "(compressed-tensors) and AWQ int4 checkpoints): serve the float checkpoint, "
            "with --quantization int8, int4 or fp8 if you want it quantized")


def _check_fp8_config(config: dict[str, Any]) -> None:
    if config.get("weight_block_size"):
        raise QuantizationError("block-wise fp8 checkpoints (weight_block_size) are not "
                                "supported: serve the bf16 checkpoint with --quantization fp8")
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8 \
                or weights.get("strategy") not in ("tensor", "channel"):
            raise QuantizationError(
                f"compressed-tensors weights {weights.get('type')}{weights.get('num_bits')} "
                f"({weights.get('strategy')}) are not supported; Slipstream reads fp8 with "
                "per-tensor or per-channel scales: serve the float checkpoint instead")


def _fp8_tensors(shard: Any, names: list[str]
                 ) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    present = set(names)
    for name in names:
        if name.endswith((".weight_scale", ".input_scale", ".weight_scale_inv")):
            continue
        tensor = shard.get_tensor(name)
        scale_name = name.removesuffix(".weight") + ".weight_scale"
        if tensor.dtype == torch.float8_e4m3fn:
            if scale_name not in present:
                raise QuantizationError(f"fp8 tensor {name} has no {scale_name}")
            scale = shard.get_tensor(scale_name).to(torch.float32).reshape(-1)
            yield name, Fp8Weight(tensor.contiguous(), scale.contiguous())
        else:
            yield name, tensor


# AWQ's GEMM kernels pack 8 values per int32 in this order of the output columns.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] -> uint8 [rows, cols] in 0..15, undoing AWQ's column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = ((words[..., None] >> shifts) & 0xF).to(torch.uint8)  # [rows, cols/8, 8]
    columns = torch.empty_like(nibbles)
    for position, column in enumerate(_AWQ_ORDER):
        columns[..., column] = nibbles[..., position]
    return columns.reshape(words.shape[0], -1)


def _awq_tensors(shard: Any, names: list[str], config: dict[str, Any]
                 ) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    if config.get("bits", 4) != 4 or str(config.get("version", "gemm")).lower() != "gemm" \
            or not config.get("zero_point", True):
        raise QuantizationError(
            f"AWQ with bits={config.get('bits')}, version={config.get('version')}, "
            f"zero_point={config.get('zero_point')} is not supported (Slipstream reads 4-bit "
            "GEMM AWQ with zero points): serve the float checkpoint instead")
    group_size = int(config.get("group_size", 128))
    for name in names:
        if name.endswith((".qzeros", ".scales")):
            continue
        if not name.endswith(".qweight"):
            yield name, shard.get_tensor(name)
            continue
        prefix = name.removesuffix(".qweight")
        values = _unpack_awq(shard.get_tensor(name))  # [in, out]
        zeros = _unpack_awq(shard.get_tensor(prefix + ".qzeros")).to(torch.float32)  # [g, out]
        scales = shard.get_tensor(prefix + ".scales").to(torch.float32)  # [groups, out]
        scale = scales.T.contiguous()
        yield prefix + ".weight", Int4Weight(pack_nibbles(values.T.contiguous()), scale,
                                             (-zeros.T * scale).contiguous(), group_size)
