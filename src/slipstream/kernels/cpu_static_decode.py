"""Decode attention for compiled CPU decode steps (``step/decode_graphs.py`` with
``cpu_compile``): the CPU counterpart of ``triton_backend.StaticDecodeAttention``.

A compiled decode program is one inductor graph per batch size with static shapes, called
directly with the same tensors every step (no Dynamo guards), so nothing in it may depend on
a step's KV lengths. Attention does, so it stays outside the graph as one opaque operator,
``slipstream::cpu_decode_attention``, that reads the step's rows from the program's static
buffers when it runs: it writes this step's key and value into their slots, gathers each
row's cached tokens and runs SDPA over them. It is registered with ``torch.library``, so
inductor keeps it as a call and fuses everything around it. Like vLLM's attention operator
under ``torch.compile``, it reaches the KV cache outside the graph (``kv_caches_in_use``).
Sliding windows and soft-capping are not here: a model with such layers keeps eager decodes.

Its kernel is C++ (``cpu_decode_attention.cpp``, built at start-up by ``use_implementation``)
where a compiler is found, and this module's Python function otherwise: the same work, minus
the Python call of each layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.kernels.attention import BLOCK_START, KV_LEN, AttentionResult

log = logging.getLogger(__name__)

# The KV caches of the program running on this thread (``kv_caches_in_use``): the attention
# operator finds its layer's cache here, so the cache is neither an input nor an output of the
# compiled graph. That keeps the graph free of the cache's block count, which is sized from
# free memory and differs between starts (a different count would miss inductor's on-disk
# cache and cost a full compile), and of the bookkeeping of a mutated input (it measured
# 25 us per layer). Only layer indices are baked into the graph, so every engine's programs
# of one model share inductor's cache entry.
_in_use = threading.local()


@contextlib.contextmanager
def kv_caches_in_use(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """The caches that ``cpu_decode_attention`` calls on this thread read and write (one
    ``(k, v)`` per layer), for the duration of one run of a program: the rows it reads from
    the static buffers are worked out by its first layer and reused by the others (the
    Python implementation); the C++ one is handed them as a flat list."""
    _in_use.caches, _in_use.rows = kv_caches, None
    native = _implementation == NATIVE
    if native:
        torch.ops.slipstream_cpu.set_kv_caches([t for pair in kv_caches for t in pair])
    try:
        yield
    finally:
        _in_use.caches, _in_use.rows = None, None
        if native:
            torch.ops.slipstream_cpu.clear_kv_caches()


@dataclass(frozen=True)
class _Rows:
    """One run's rows, the same for every layer: where their new tokens go and which cached
    tokens each attends to (flat slots, in order)."""

    buffers: tuple[int, int, int]  # data pointers of the slots, seq_info and blocks read
    slots: torch.Tensor  # [rows with KV]
    # Per row with KV: its flat slots [kv_len], or the slice of them when its blocks are
    # consecutive (a view of the cache, no gather: usual for a lone stream).
    tokens: tuple[torch.Tensor | slice, ...]
    padded: int  # rows including padding


def _rows(slot_mapping: torch.Tensor, seq_info: torch.Tensor, block_indices: torch.Tensor,
          block_size: int) -> _Rows:
    buffers = (slot_mapping.data_ptr(), seq_info.data_ptr(), block_indices.data_ptr())
    known: _Rows | None = getattr(_in_use, "rows", None)
    if known is not None and known.buffers == buffers:
        return known
    info = [row for row in seq_info.tolist() if row[KV_LEN] > 0]
    offsets = torch.arange(block_size)
    tokens: list[torch.Tensor | slice] = []
    for row in info:
        kv_len, start = row[KV_LEN], row[BLOCK_START]
        blocks = block_indices[start:start + -(-kv_len // block_size)]
        first = int(blocks[0])
        if bool((blocks == torch.arange(first, first + len(blocks))).all()):
            tokens.append(slice(first * block_size, first * block_size + kv_len))
        else:
            tokens.append((blocks[:, None] * block_size + offsets).flatten()[:kv_len])
    rows = _Rows(buffers, slot_mapping[:len(info)], tuple(tokens), seq_info.shape[0])
    _in_use.rows = rows
    return rows


def cpu_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         layer: int, slot_mapping: torch.Tensor, seq_info: torch.Tensor,
                         block_indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Write row ``r``'s ``key``/``value`` into flat slot ``slot_mapping[r]`` of layer
    ``layer`` of the caches in use (``kv_caches_in_use``; padding rows, with no KV and slot
    -1, come last and write nothing), then attend with ``query [rows, heads, dim]`` to each
    row's first ``seq_info[r, KV_LEN]`` cached tokens, whose blocks start at
    ``block_indices[seq_info[r, BLOCK_START]]``. A padding row gets zeros.

    One operator for both, so that a layer pays one dispatch from the compiled program. It
    declares no mutated argument because it mutates none: the cache it writes is not an
    argument, and nothing else in the graph reads it."""
    caches = getattr(_in_use, "caches", None)
    if caches is None:
        raise RuntimeError("cpu_decode_attention runs inside kv_caches_in_use()")
    k_cache, v_cache = caches[layer]
    rows = _rows(slot_mapping, seq_info, block_indices, k_cache.shape[1])
    count = len(rows.tokens)
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    if count:
        k_flat.index_copy_(0, rows.slots, key[:count].to(k_cache.dtype))
        v_flat.index_copy_(0, rows.slots, value[:count].to(v_cache.dtype))
    if count == 1 and rows.padded == 1:  # one stream: no copy into a zeroed output
        return _attend(query[0], k_flat, v_flat, rows.tokens[0], scale).unsqueeze(0)
    output = torch.zeros_like(query)
    for row, tokens in enumerate(rows.tokens):
        output[row] = _attend(query[row], k_flat, v_flat, tokens, scale)
    return output


def _attend(query: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
            tokens: torch.Tensor | slice, scale: float) -> torch.Tensor:
    """One row: ``query [heads, dim]`` over the cached tokens at flat slots ``tokens``
    -> ``[heads, dim]``."""
    if isinstance(tokens, slice):
        keys, values = k_flat[tokens].transpose(0, 1), v_flat[tokens].transpose(0, 1)
    else:
        keys = k_flat.index_select(0, tokens).transpose(0, 1)
        values = v_flat.index_select(0, tokens).transpose(0, 1)
    return F.scaled_dot_product_attention(
        query.unsqueeze(1), keys.to(query.dtype), values.to(query.dtype), scale=scale,
        enable_gqa=True).squeeze(1)


def _cpu_decode_attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                layer: int, slot_mapping: torch.Tensor,
                                seq_info: torch.Tensor, block_indices: torch.Tensor,
                                scale: float) -> torch.Tensor:
    return torch.empty_like(query)


# Registered through torch.library's low-level API rather than ``custom_op``: the latter wraps
# every call (a Dynamo-disabled frame, an autograd shim, an output-alias check), about 7 us a
# call, 30 calls a step. A functional schema, no autograd: decode runs under inference mode.
# Its CPU kernel is chosen once per process by ``use_implementation``.
_LIBRARY = torch.library.Library("slipstream", "FRAGMENT")
_LIBRARY.define("cpu_decode_attention(Tensor query, Tensor key, Tensor value, int layer, "
                "Tensor slot_mapping, Tensor seq_info, Tensor block_indices, float scale) "
                "-> Tensor")
torch.library.register_fake("slipstream::cpu_decode_attention", _cpu_decode_attention_shape,
                            lib=_LIBRARY)

NATIVE, PYTHON = "c++", "python"
_implementation: str | None = None
_choosing = threading.Lock()
_SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")


def native_loaded() -> bool:
    """Whether this process registered the C++ kernel (``use_implementation``), which also
    brings ``slipstream_cpu::attend_decodes`` for the eager backend's decodes."""
    return _implementation == NATIVE


def use_implementation(build_dir: Path | None) -> str:
    """Register the operator's CPU kernel, once per process, and say which: the C++ one
    (``cpu_decode_attention.cpp``, compiled into ``build_dir`` on first use, seconds, then
    loaded from there), or this module's Python function when ``build_dir`` is None or the
    build fails (a warning says why). The C++ kernel saves the Python call of each layer:
    about 25 us a layer, 0.7 ms a step of the default model (docs/engine.md).
    ``SLIPSTREAM_CPU_DECODE_KERNEL=python`` keeps the Python one (to compare the two)."""
    global _implementation
    with _choosing:
        if _implementation is None:
            _implementation = PYTHON
            if os.environ.get("SLIPSTREAM_CPU_DECODE_KERNEL") == PYTHON:
                build_dir = None
            if build_dir is not None:
                try:
                    _load_native(build_dir)
                    _implementation = NATIVE
                except Exception as error:  # noqa: BLE001 - the Python kernel serves instead
                    log.warning("the C++ decode attention kernel did not build (%s); compiled "
                                "decodes call the Python one", str(error).splitlines()[0]
                                if str(error) else type(error).__name__)
            if _implementation == PYTHON:
                _LIBRARY.impl("cpu_decode_attention", cpu_decode_attention, "CPU")
        return _implementation


def _load_native(build_dir: Path) -> None:
    from slipstream.kernels import cpp_build

    cpp_build.build("slipstream_cpu_decode_attention", _SOURCE, build_dir,
                    [f"-DKV_LEN={KV_LEN}", f"-DBLOCK_START={BLOCK_START}"])


class CpuStaticDecodeAttention:
    """Decode attention bound to a compiled program's buffers: the rows' slots, ``seq_info``
    and block indices are rewritten in place before each call. The same interface as the
    other backends' (``write_kv``, ``run``), without a plan."""

    name = "cpu-static-decode"

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 slot_mapping: torch.Tensor, seq_info: torch.Tensor,
                 block_indices: torch.Tensor) -> None:
        self.kv_caches = kv_caches  # to name a layer by its cache (run)
        self.slot_mapping = slot_mapping
        self.seq_info = seq_info
        self.block_indices = block_indices
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # write_kv's key, value

    def plan(self, metadata: object = None) -> None:
        """Nothing to plan: the step's rows are already in the bound buffers."""

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        """Kept for ``run``, which writes and attends in one operator."""
        self._pending = (key, value)

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        if return_lse:
            raise ValueError("compiled CPU decode serves one process without KV shards; it "
                             "does not compute the log-sum-exp")
        if sliding_window is not None or logit_softcap is not None:
            raise ValueError("compiled CPU decode has no sliding window or soft-capping; such "
                             "models decode eagerly")
        if self._pending is None:
            raise RuntimeError("write_kv() comes before run() in every layer")
        key, value = self._pending
        self._pending = None
        # Which layer this is, by the identity of its cache (resolved once, when traced).
        layer = next(index for index, (k, _) in enumerate(self.kv_caches) if k is k_cache)
        output = torch.ops.slipstream.cpu_decode_attention(
            query, key, value, layer, self.slot_mapping, self.seq_info,
            self.block_indices, scale)
        return AttentionResult(output=output, lse_natural=None)
