"""The tiles of the torch reference backend: how a prefill chunk or a decode group is cut so
that no call materialises more than a bounded number of attention scores, and the arithmetic
that puts the tiles back together exactly.

    torch_ref.run, per prefill chunk:
        query_tiles()          rows of queries, each with the keys it sees (up to its last query)
        fused path:            one SDPA call per query tile, mask from fused_tile_mask()
        log-sum-exp path:      attend_in_key_tiles(): softmax attention per key tile, merged
                               with merge_states (an exact online log-sum-exp)
    torch_ref.run, per decode group: row tiles of rows_per_tile() rows (the same bound)

Masking rule, as everywhere in Slipstream: the query at absolute position ``p`` sees the key
at absolute position ``k`` iff ``k <= p`` (and, in a layer with a sliding window ``w``,
``k > p - w``). A KVP shard's keys start at ``kv_start``.

Within a query tile whose first query is at ``p0``, the keys up to ``p0`` are seen by every row
(the *shared* keys: no mask), and the keys after it, up to the tile's last query, form a band
that row ``i`` sees strictly before its own offset: a lower triangle, the only part that needs
a mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slipstream.kernels.attention import merge_states

# The most attention scores one call may materialise, counted as query heads x queries x
# keys: 2^24, 64 MiB in float32. The log-sum-exp path materialises exactly that per key tile
# (its softmax works in place on the scores); SDPA's fused CPU kernel keeps its scores in small
# blocks of its own and materialises only the mask, one element per (query, key), so a tile
# sized by this bound costs it 1/heads of it (16 MiB for 4 heads), and its unfused fallback
# would materialise the bound itself. Large enough that a tile's matmuls dwarf the per-call
# overhead: a 4-head model gets 2,048 x 2,048 log-sum-exp tiles and 128-query fused tiles
# against 32K keys.
MAX_SCORE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class QueryTile:
    """Rows ``row_start:row_end`` of a chunk's queries and the keys they see."""

    row_start: int
    row_end: int
    visible_keys: int  # keys [0, visible_keys) of the shard: what the tile's last row sees
    shared_keys: int  # keys [0, shared_keys): what the first row, and so every row, sees

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


def spans(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into consecutive pieces of at most ``step``."""
    return [(lo, min(lo + step, end)) for lo in range(start, end, step)]


def query_tiles(q_len: int, query_start: int, kv_start: int, kv_len: int,
                max_rows: int) -> list[QueryTile]:
    """A chunk of ``q_len`` queries from absolute position ``query_start``, over ``kv_len`` keys
    from ``kv_start``, cut into tiles of at most ``max_rows`` queries. Rows that see no key (a
    shard that starts after them, or an empty one) are in no tile: their output is zero."""
    if kv_len == 0:
        return []
    first_seeing = min(max(kv_start - query_start, 0), q_len)
    tiles = []
    for row_start, row_end in spans(first_seeing, q_len, max_rows):
        first_pos = query_start + row_start
        visible = min(kv_len, query_start + row_end - kv_start)
        tiles.append(QueryTile(row_start, row_end, visible,
                               shared_keys=min(first_pos - kv_start + 1, visible)))
    return tiles


def rows_per_tile(max_elements: int, num_heads: int, kv_len: int) -> int:
    """Query rows per call when every row takes all ``kv_len`` keys (SDPA has no log-sum-exp
    to merge key tiles with): at least one."""
    return max(1, max_elements // (num_heads * max(kv_len, 1)))


def lse_tile_sizes(max_elements: int, num_heads: int, q_len: int,
                   kv_len: int) -> tuple[int, int]:
    """(query rows, keys) per tile of the log-sum-exp path. Whole key rows when they fit
    beside all the queries, or beside a square tile's worth, so a short context takes a single
    pass; square tiles otherwise, which do the fewest merges for the bound."""
    pairs = max(1, max_elements // num_heads)  # (query, key) pairs per tile
    key_tile = max(1, min(kv_len, max(math.isqrt(pairs), pairs // max(q_len, 1))))
    return max(1, min(q_len, pairs // key_tile)), key_tile


def band_visible(rows: int, start: int, end: int, device: torch.device) -> torch.Tensor:
    """``[rows, end - start]`` bool: whether a tile's row ``i`` sees band key ``start + j``,
    i.e. whether that key comes before the row's own position (``start + j < i``). Band keys
    count from the end of the shared keys; a negative ``start`` reaches into them."""
    row = torch.arange(rows, device=device)[:, None]
    return torch.arange(start, end, device=device)[None, :] < row


def fused_tile_mask(tile: QueryTile, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for one SDPA call over a tile's visible keys. No mask when the
    tile sees all of them; SDPA's own causal mask (top-left: row ``i`` sees keys ``0..i``)
    when the tile starts at the shard's first key; else an additive mask in the query's
    dtype, which SDPA would otherwise build from a boolean one next to it."""
    band = tile.visible_keys - tile.shared_keys
    if band == 0:
        return None, False
    if tile.shared_keys == 1:  # the first row sees only key 0: the tile starts at kv_start
        return None, True
    mask = torch.zeros(tile.num_rows, tile.visible_keys, dtype=dtype, device=device)
    hidden = ~band_visible(tile.num_rows, 0, band, device)
    mask[:, tile.shared_keys:].masked_fill_(hidden, float("-inf"))
    return mask, False


def masked_softmax_attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor | None, scale: float,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale, masked) v in float32, plus the natural log-sum-exp of the masked
    scores. ``query`` [..., q, dim], ``keys`` [..., dim, kv], ``values`` [..., kv, dim]; the
    softmax works in place on the one score tensor. ``softcap``: the scores become
    ``softcap * tanh(scores / softcap)`` first (Gemma 2)."""
    scores = torch.matmul(query.float(), keys.float()).mul_(scale)
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # Rows with nothing visible: keep the arithmetic finite; their total is 0, lse -inf.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = scores.sub_(row_max).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    lse = (total.log() + row_max).squeeze(-1)
    out = torch.matmul(weights, values.float())
    return out.div_(torch.where(total > 0, total, torch.ones_like(total))), lse


def attend_in_key_tiles(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        scale: float, key_spans: list[tuple[int, int]],
                        mask_of: Callable[[int, int], torch.Tensor | None],
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` over the keys in ``key_spans`` (``keys`` [..., dim, kv],
    ``values`` [..., kv, dim]), one span at a time, each with ``mask_of(start, end)`` (None:
    every key visible), merged by log-sum-exp: the exact result, in float32, with its lse."""
    if not key_spans:
        raise ValueError("attention needs at least one span of keys")
    output: torch.Tensor | None = None
    lse = torch.empty(0)
    for start, end in key_spans:
        part, part_lse = masked_softmax_attend(query, keys[..., start:end],
                                               values[..., start:end, :], mask_of(start, end),
                                               scale, softcap)
        if output is None:
            output, lse = part, part_lse
        else:
            output, lse = merge_states(output, lse, part, part_lse)
    assert output is not None
    return output, lse
