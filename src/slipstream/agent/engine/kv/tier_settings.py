"""``--kv-host-memory``, ``--kv-disk-path`` and ``--kv-disk-size``: the KV tiers under the
device pool, as sizes (pure data; the flags and the CRD parse into it without torch).

    KVTierSettings (bytes, a path) --ModelRunner.enable_kv_tiers()--> KVTierStore (the bytes)
                                                                 --> KVTierConfig (blocks, GB/s)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slipstream.agent.config.sizes import SIZE_PATTERN, parse_size_bytes  # re-exported

__all__ = ["SIZE_PATTERN", "KVTierSettings", "parse_size_bytes"]


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
