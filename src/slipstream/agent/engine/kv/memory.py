"""How big the paged KV cache is: a share of the memory that is actually free.

    --kv-cache-memory (a fraction, or a size like 4GiB) -> KVCacheMemory
    free memory on the device after the weights are loaded -> plan_kv_cache() -> KVCachePlan

The default follows vLLM: on CUDA ``gpu_memory_utilization``-style, a large share of the
device memory still free once the weights are in place; on CPU a smaller share of the RAM
the kernel reports as available (``MemAvailable``, bounded by the container's cgroup limit),
since the machine runs other things. The cache never takes more than the engine could use
(``max_num_seqs`` requests of ``max_model_len`` tokens each), and it must hold at least one
request of ``max_model_len`` tokens: if that does not fit, the engine refuses to start with
one line that says what to change.

On CPU the blocks are allocated zeroed but untouched (``calloc``), so the kernel only backs
the pages a request actually writes: an idle server holds its weights, not its KV budget.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the flags parse without torch; allocation imports it
    import torch

from slipstream.agent.config.sizes import (  # re-exported: the flags parse it
    DEFAULT_CPU_FRACTION, DEFAULT_CUDA_FRACTION, KVCacheMemory)


class KVCacheSizeError(ValueError):
    """The cache the settings ask for cannot be allocated; the message says what to change."""


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    bytes_per_block: int
    available_bytes: int | None  # free memory the rule read (None: a fixed size was given)
    reason: str  # one line for the start-up log

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def format_bytes(size: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def plan_kv_cache(*, requested: KVCacheMemory, device_type: str, available_bytes: int | None,
                  bytes_per_block: int, block_size: int, max_model_len: int,
                  max_num_seqs: int) -> KVCachePlan:
    """The number of KV blocks for these settings, or KVCacheSizeError.

    ``available_bytes`` is the free memory on the device (after the weights); it may be None
    only when a fixed size is requested.
    """
    min_blocks = math.ceil(max_model_len / block_size)
    useful_blocks = max_num_seqs * min_blocks  # more than this can never be used
    minimum = min_blocks * bytes_per_block
    needs = (f"one {max_model_len}-token request needs {format_bytes(minimum)} of KV "
             f"({bytes_per_block // block_size:,} bytes per token)")
    if requested.size_bytes is not None:
        if requested.size_bytes < minimum:
            raise KVCacheSizeError(f"--kv-cache-memory {format_bytes(requested.size_bytes)} "
                                   f"is too small: {needs}; raise it or lower --max-model-len")
        if available_bytes is not None and requested.size_bytes > available_bytes:
            raise KVCacheSizeError(f"--kv-cache-memory {format_bytes(requested.size_bytes)} "
                                   f"does not fit: only {format_bytes(available_bytes)} is free "
                                   f"on {device_type}")
        blocks = requested.size_bytes // bytes_per_block
        source = f"--kv-cache-memory {format_bytes(requested.size_bytes)}"
    else:
        if available_bytes is None:
            raise ValueError("plan_kv_cache needs the free memory to size a fraction")
        fraction = requested.fraction if requested.fraction is not None else (
            DEFAULT_CUDA_FRACTION if device_type == "cuda" else DEFAULT_CPU_FRACTION)
        blocks = int(available_bytes * fraction) // bytes_per_block
        source = f"{fraction:g} of {format_bytes(available_bytes)} free on {device_type}"
        if blocks < min_blocks:
            flag = ("a larger --kv-cache-memory fraction, " if requested.fraction is not None
                    else "")
            if minimum > available_bytes or requested.fraction is not None:
                raise KVCacheSizeError(f"the KV cache does not fit: {source} is "
                                       f"{format_bytes(blocks * bytes_per_block)}, but {needs}; "
                                       f"use {flag}a lower --max-model-len, or free memory")
            blocks = min_blocks  # the default share is too small, but the minimum fits
            source += f", raised to the minimum: {needs}"
    if blocks > useful_blocks:
        blocks = useful_blocks
        source += (f", capped at what {max_num_seqs} requests of {max_model_len} tokens "
                   f"can use")
    total = blocks * bytes_per_block
    return KVCachePlan(num_blocks=blocks, bytes_per_block=bytes_per_block,
                       available_bytes=available_bytes,
                       reason=f"KV cache: {blocks:,} blocks of {block_size} tokens "
                              f"({blocks * block_size:,} tokens, {format_bytes(total)}) from "
                              f"{source}")


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: on CUDA the driver's free bytes on that device; on CPU the kernel's
    ``MemAvailable``, bounded by the cgroup limit when the process runs in one."""
    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available()
    cgroup_free = _cgroup_free()
    return min(available, cgroup_free) if cgroup_free is not None else available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Not Linux: the physical pages not in use, as the C library sees them.
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_free() -> int | None:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 2**60:
            return None
        return max(0, int(limit_text) - usage)
    return None


def allocate_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On CPU it is an anonymous memory map of its own: the kernel's pages
    are zero and mapped on first write, so untouched blocks cost no resident memory. (Not
    ``calloc``: with the engine's heap thresholds, step/cpu_heap.py, a large request can be
    served from freed heap memory, which calloc clears, and so backs, at once.)"""
    import mmap

    import numpy as np
    import torch

    if device.type != "cpu" or math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    element_bytes = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else \
        torch.iinfo(dtype).bits // 8
    region = mmap.mmap(-1, math.prod(shape) * element_bytes)  # freed with the last view
    raw = np.frombuffer(region, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)
