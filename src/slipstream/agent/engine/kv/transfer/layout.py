"""What a block of KV cache looks like in memory, so that two instances can agree on it.

The model runner keeps, per layer, one K and one V tensor of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Block ``b`` of such a tensor is one
contiguous run of ``block_bytes`` bytes at ``base + b * block_bytes``. A block of a request
therefore moves as ``2 * num_layers`` contiguous segments, one per tensor ("region").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def num_regions(self) -> int:
        return 2 * self.num_layers

    @property
    def element_bytes(self) -> int:
        return torch.finfo(_DTYPES[self.dtype]).bits // 8

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one region (one layer's K or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, K and V."""
        return self.block_bytes * self.num_regions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KVLayout:
        return cls(**{name: raw[name] for name in
                      ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")})

    @classmethod
    def of(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVLayout:
        key = kv_caches[0][0]
        dtype = next(name for name, value in _DTYPES.items() if value == key.dtype)
        _, block_size, heads, head_dim = key.shape
        return cls(len(kv_caches), block_size, heads, head_dim, dtype)


def regions_of(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The runner's KV tensors in region order: layer 0 K, layer 0 V, layer 1 K, ..."""
    regions = [tensor for pair in kv_caches for tensor in pair]
    for tensor in regions:
        if not tensor.is_contiguous():
            raise ValueError("KV tensors must be contiguous to be transferred block by block")
    return regions
