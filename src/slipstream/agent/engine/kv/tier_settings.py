"""``--kv-host-memory``, ``--kv-disk-path`` and ``--kv-disk-size``: the KV tiers under the
device pool, as sizes (pure data; the flags and the CRD parse into it without torch).

    KVTierSettings (bytes, a path) --ModelRunner.enable_kv_tiers()--> KVTierStore (the bytes)
                                                                 --> KVTierConfig (blocks, GB/s)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# A size with its unit, as --kv-host-memory and the CRD's kvTiers fields take it. The CRD's
# CEL rule uses the same pattern, so the API server refuses what serve would refuse.
SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$"
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10,
          "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size_bytes(text: str) -> int:
    """``512GiB``, ``1TiB``, ``1.5GB``: a size with its unit, in bytes."""
    match = re.match(SIZE_PATTERN, text.strip())
    if match is None:
        raise ValueError(f"expected a size with a unit (512MiB, 8GiB, 1TiB), got {text!r}")
    unit = match.group(2)
    return int(float(text.strip()[:-len(unit)]) * _UNITS[unit])


@dataclass(frozen=True)
class KVTierSettings:
    host_memory_bytes: int = 0  # 0: no host tier (and then no disk tier)
    disk_path: Path | None = None
    disk_size_bytes: int = 0

    def __post_init__(self) -> None:
        if self.host_memory_bytes < 0 or self.disk_size_bytes < 0:
            raise ValueError("KV tier sizes must be >= 0")
        if (self.disk_path is None) != (self.disk_size_bytes == 0):
            raise ValueError("--kv-disk-path and --kv-disk-size go together")
        if self.disk_path is not None and not self.host_memory_bytes:
            raise ValueError("a disk tier needs a host tier (--kv-host-memory): disk blocks "
                             "are staged through host memory")

    @property
    def enabled(self) -> bool:
        return self.host_memory_bytes > 0
