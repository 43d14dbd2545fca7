"""Sizes as the settings spell them, parsed without torch (the operator and the CLI read them):

    --kv-cache-memory / engine.kvCacheMemory: "0.5" or "4GiB" -> KVCacheMemory
    --kv-host-memory / kvTiers.hostMemory: "64GiB" -> bytes (parse_size_bytes)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A size with its unit, as --kv-host-memory and the CRD's kvTiers fields take it. The CRD's
# CEL rule uses the same pattern, so the API server refuses what serve would refuse.
SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$"
_TIER_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10,
               "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size_bytes(text: str) -> int:
    """``512GiB``, ``1TiB``, ``1.5GB``: a size with its unit, in bytes."""
    match = re.match(SIZE_PATTERN, text.strip())
    if match is None:
        raise ValueError(f"expected a size with a unit (512MiB, 8GiB, 1TiB), got {text!r}")
    unit = match.group(2)
    return int(float(text.strip()[:-len(unit)]) * _TIER_UNITS[unit])


# Share of the free memory the cache takes by default.
DEFAULT_CPU_FRACTION = 0.2
DEFAULT_CUDA_FRACTION = 0.9

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class KVCacheMemory:
    """``--kv-cache-memory``: a fraction of the free memory (0 < f <= 1) or a size in bytes.
    Neither set: the device's default fraction."""

    fraction: float | None = None
    size_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.fraction is not None and self.size_bytes is not None:
            raise ValueError("give a fraction or a size for the KV cache, not both")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"a KV cache fraction must be in (0, 1], got {self.fraction}")
        if self.size_bytes is not None and self.size_bytes < 1:
            raise ValueError(f"a KV cache size must be positive, got {self.size_bytes} bytes")

    @classmethod
    def parse(cls, text: str) -> KVCacheMemory:
        """``0.3`` (a fraction of free memory) or a size with a unit: ``4GiB``, ``512MiB``,
        ``2G``, ``1500MB``."""
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"expected a fraction (0.3) or a size with a unit (4GiB, 512MiB), "
                             f"got {text!r}")
        value = float(match.group(1))
        if unit == "":
            if not 0.0 < value <= 1.0:
                raise ValueError(f"a bare number is a fraction of free memory in (0, 1]; give "
                                 f"a size with its unit (4GiB, 512MiB), got {text!r}")
            return cls(fraction=value)
        return cls(size_bytes=int(value * _UNITS[unit]))
