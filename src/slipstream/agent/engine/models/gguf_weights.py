"""A GGUF file's tensors kept in their quantized form, for the loader.

    FILE.gguf --GGUFReader (memory-mapped)--> per tensor:
        Q4_0, Q4_1 blocks  -> Int4Weight, group 32 (the block's scale and minimum as they are)
        Q4_K super-blocks  -> Int4Weight, group 32 (each sub-block's scale and minimum)
        Q8_0 blocks        -> Int8GroupWeight, group 32 (the block's values and scale)
        F32, F16, BF16     -> float tensors (norms)
        anything else      -> float32 through the gguf library, with one warning naming the cost
        mixture-of-experts experts, routers, shared-expert gates, whatever their type
                           -> the serving float dtype, with one warning naming the cost

Q4_1 stores 32 weights as ``d * q + m`` (``d``, ``m`` float16, ``q`` 4 bits): our int4 group
32 with scale ``d`` and minimum ``m``, bit for bit. Q4_0 is ``d * (q - 8)``: minimum ``-8 d``.
A block's 16 bytes hold weights 0-15 in their low nibbles and 16-31 in their high nibbles.

Q8_0 (32 int8 values per float16 scale) is kept as it is and multiplied as two exact int4
planes (``Int8GroupWeight.int4_planes``). An earlier version requantized it to one int8 scale
per row for ``_weight_int8pack_mm``: that moved SmolLM2's tied embedding and LM head by 1.2 %
(relative RMS); greedy agreement with llama.cpp on the same file (20 prompts, 32 tokens) was
49 % with it and 53 % with the planes. In llama.cpp files Q8_0 is mostly the token embedding, which is also
the tied LM head.

Q4_K repacks exactly: its 256-weight super-blocks hold eight sub-blocks of 32, each ``d sc q -
dmin m`` with 6-bit ``sc`` and ``m``. The other K-quants (Q5_K, Q6_K, Q2_K, Q3_K) and the other
block types (Q5_0, Q5_1, IQ...) need more than 4 bits or have no format here: they are
dequantized to float32, tensor by tensor, and the warning names how many bytes that costs over
the file.

Experts stay quantized in llama.cpp; here they run as float matmuls (``models/moe.py``
``GroupedExperts``), so a Q4_K Mixtral (4.5 bits a weight) holds its experts at 3.6 (bfloat16)
or 7.1 (float32) times the file's bytes. Each layer's gate and up stacks are fused as they
arrive (``gguf_moe.py``).

The Q/K rows that llama.cpp's converter permuted for its RoPE layout are put back here too;
the permutation moves whole rows, so it applies to values and per-row scales alike.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipstream.agent.engine.models.gguf_archs import norm_weight_offset, rope_rows_permuted
from slipstream.agent.engine.models.gguf_model import gguf_tensor_name, unpermute_rope_rows
from slipstream.agent.engine.models.gguf_moe import fuse_expert_stacks, kept_float, model_shape
from slipstream.agent.engine.models.weight_formats import (Int4Weight, Int8GroupWeight,
                                                           QuantizedWeight, pack_nibbles)

log = logging.getLogger(__name__)

_FLOAT_TYPES = ("F32", "F16", "BF16")
_INT4_TYPES = ("Q4_0", "Q4_1")
KEPT_TYPES = (*_INT4_TYPES, "Q4_K", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}  # per block


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds (for logs and the profile key)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def weight_format_name(path: Path) -> str:
    """``gguf:`` and the file's tensor types, e.g. ``gguf:F32+Q4_1+Q8_0``."""
    return "gguf:" + "+".join(sorted(gguf_tensor_types(path)))


def _int4_from_blocks(blocks: np.ndarray, rows: int, kind: str) -> Int4Weight:
    """Q4_0 / Q4_1 blocks ``[rows * blocks_per_row, bytes]`` as group-32 int4."""
    header = 2 if kind == "Q4_0" else 4
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    if kind == "Q4_1":
        minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    else:
        minimum = -8.0 * scale
    nibbles = torch.from_numpy(np.ascontiguousarray(blocks[:, header:]))  # [n, 16]
    values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=1)  # weights 0-15, then 16-31
    packed = pack_nibbles(values.reshape(rows, -1))
    return Int4Weight(packed.contiguous(), torch.from_numpy(scale), torch.from_numpy(minimum), 32)


def _int4_from_q4_k(blocks: np.ndarray, rows: int) -> Int4Weight:
    """Q4_K super-blocks (256 weights: float16 ``d`` and ``dmin``, eight 6-bit scales and
    minimums, 4-bit values) as int4 group 32: sub-block ``j`` is ``d sc_j q - dmin m_j``,
    our scale ``d sc_j`` and minimum ``-dmin m_j``, computed in float32 as llama.cpp does."""
    from gguf.quants import Q4_K

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sub_scales, sub_minimums = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scale = (d * sub_scales.astype(np.float32)).reshape(rows, -1)
    minimum = -(dmin * sub_minimums.astype(np.float32)).reshape(rows, -1)
    # Each 32 bytes hold two sub-blocks: the low nibbles the first, the high nibbles the next.
    nibbles = torch.from_numpy(np.ascontiguousarray(blocks[:, 16:])).view(-1, 4, 1, 32)
    values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=2)  # [n, 4 chunks, 2, 32]
    packed = pack_nibbles(values.reshape(rows, -1))
    return Int4Weight(packed.contiguous(), torch.from_numpy(scale),
                      torch.from_numpy(np.ascontiguousarray(minimum)), 32)


def _int8_from_q8_0(blocks: np.ndarray, rows: int) -> Int8GroupWeight:
    """Q8_0 blocks as int8 group 32: the block's values and scale as they are."""
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    values = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).view(np.int8))
    return Int8GroupWeight(values.reshape(rows, -1).contiguous(), torch.from_numpy(scale), 32)


def _unpermute(weight: QuantizedWeight | torch.Tensor, heads: int
               ) -> QuantizedWeight | torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return torch.from_numpy(np.ascontiguousarray(unpermute_rope_rows(weight.numpy(), heads)))

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(unpermute_rope_rows(tensor.numpy(), heads)))

    if isinstance(weight, Int4Weight):
        return Int4Weight(rows(weight.packed), rows(weight.scale), rows(weight.minimum),
                          weight.group_size)
    if isinstance(weight, Int8GroupWeight):
        return Int8GroupWeight(rows(weight.values), rows(weight.scale), weight.group_size)
    raise TypeError(f"unexpected {type(weight).__name__} in a GGUF")


def read_gguf_weights(path: Path, config: dict[str, Any], float_dtype: torch.dtype = torch.float32
                      ) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    """Each tensor of the file under its Hugging Face name: quantized where Slipstream has a
    format for its blocks, float otherwise. ``config``: the converted ``config.json``;
    ``float_dtype``: the dtype the model is served in (mixture-of-experts tensors are cast to
    it here, and the warning counts their bytes in it)."""
    return fuse_expert_stacks(_read_tensors(path, config, float_dtype),
                              lambda gate, up: torch.cat([gate, up], dim=1))


def _read_tensors(path: Path, config: dict[str, Any], float_dtype: torch.dtype
                  ) -> Iterator[tuple[str, QuantizedWeight | torch.Tensor]]:
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    fallback: dict[str, list[int]] = {}  # type -> [tensors, file bytes, float32 bytes]
    experts: dict[str, list[int]] = {}  # type -> [tensors, file bytes, float_dtype bytes]
    for tensor in reader.tensors:
        target = gguf_tensor_name(tensor.name, config)
        kind = tensor.tensor_type.name
        shape = model_shape(tensor.name, tuple(int(dim) for dim in reversed(tensor.shape)))
        rows = shape[0]
        weight: QuantizedWeight | torch.Tensor
        if kept_float(tensor.name):
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            weight = torch.from_numpy(np.array(array.reshape(shape))).to(float_dtype)
            if kind not in _FLOAT_TYPES:
                entry = experts.setdefault(kind, [0, 0, 0])
                entry[0] += 1
                entry[1] += int(tensor.n_bytes)
                entry[2] += weight.numel() * weight.element_size()
        elif kind in _INT4_TYPES:
            weight = _int4_from_blocks(np.asarray(tensor.data).reshape(-1, _BLOCK_BYTES[kind]),
                                       rows, kind)
        elif kind == "Q4_K":
            weight = _int4_from_q4_k(np.asarray(tensor.data).reshape(-1, _BLOCK_BYTES[kind]),
                                     rows)
        elif kind == "Q8_0":
            weight = _int8_from_q8_0(np.asarray(tensor.data).reshape(-1, _BLOCK_BYTES[kind]),
                                     rows)
        else:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            weight = torch.from_numpy(np.array(array.reshape(shape), dtype=np.float32))
            if kind not in _FLOAT_TYPES:
                entry = fallback.setdefault(kind, [0, 0, 0])
                entry[0] += 1
                entry[1] += int(tensor.n_bytes)
                entry[2] += weight.numel() * 4
        heads = rope_rows_permuted(tensor.name, config.get("model_type", "llama"))
        if heads is not None:
            weight = _unpermute(weight, config[heads])
        offset = norm_weight_offset(tensor.name, config.get("model_type", "llama"))
        if offset and isinstance(weight, torch.Tensor):
            weight = weight - offset
        yield target, weight
    del reader  # releases the file mapping: nothing above keeps a view of it
    if experts:
        counts = " + ".join(f"{count} {kind}" for kind, (count, _, _) in sorted(experts.items()))
        log.warning("GGUF %s: %s mixture-of-experts tensors (experts, routers) are dequantized "
                    "to %s at load, as Slipstream's experts run in float: %.1f MB in memory "
                    "instead of %.1f MB in the file", path.name, counts,
                    str(float_dtype).removeprefix("torch."),
                    sum(entry[2] for entry in experts.values()) / 1e6,
                    sum(entry[1] for entry in experts.values()) / 1e6)
    for kind, (count, file_bytes, float_bytes) in sorted(fallback.items()):
        log.warning("GGUF %s: %d %s tensor(s) have no quantized kernel in Slipstream and are "
                    "dequantized to float32: %.1f MB in memory instead of %.1f MB in the file",
                    path.name, count, kind, float_bytes / 1e6, file_bytes / 1e6)
