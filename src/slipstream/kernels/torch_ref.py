"""Paged attention in plain torch: the CPU backend and the reference the GPU backend is tested
against.

``plan`` turns block tables into flat slot indices (and decode masks) once per step; every
layer then gathers its keys/values with one indexing op. Decodes (one query token each) are
computed in groups of similar KV length, each group padded to its longest KV; prefill chunks
are computed one sequence at a time, each causal over its cached tokens plus its new ones.

Why groups: padding every decode to the batch's longest KV makes one long request's decode
cost ``batch x its KV``. With 150 short decodes beside one 24K-token decode, that is 40x the
work of the short decodes alone, and every request in the batch waits for it. The runtime
predictor models decode attention by the batch's *total* KV, as a ragged GPU kernel costs;
grouping keeps the CPU path within 2x of that.

Why tiles: one attention call over a whole chunk materialises ``queries x keys`` per call: an
8,192-token chunk against 32K cached keys is a 1 GiB float mask for SDPA, and for the
log-sum-exp path a ``[heads, 8192, 32768]`` float32 score matrix (4 GiB at 4 heads). Every call
here covers at most ``max_score_elements`` (query heads x queries x keys; see
:mod:`~slipstream.kernels.attention_tiles`): prefill chunks run in query tiles, each over only
the keys up to its last query, and the log-sum-exp path also cuts the keys into tiles merged by
an exact online log-sum-exp. Decode groups are cut into row tiles by the same bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from slipstream.kernels.attention import AttentionMetadata, AttentionResult
from slipstream.kernels.attention_tiles import (
    MAX_SCORE_ELEMENTS, QueryTile, attend_in_key_tiles, band_visible, fused_tile_mask,
    lse_tile_sizes, query_tiles, rows_per_tile, spans)


@dataclass(frozen=True)
class _DecodeGroup:
    """Decodes of similar KV length, computed together with their KV padded to whole blocks."""

    blocks: torch.Tensor  # [rows, blocks]: each row's block ids, padded to the longest KV
    mask: torch.Tensor  # [rows, kv]: True where the row may attend (hides padding and shards)
    token_start: int  # first query row in the flat token dimension (contiguous groups)
    token_end: int
    rows: torch.Tensor | None = None  # the query rows, when not token_start:token_end
    # Each row's query position and first key's position, for sliding-window layers.
    query_pos: torch.Tensor | None = None  # [rows]
    kv_start: torch.Tensor | None = None  # [rows]

    @property
    def num_rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def kv_len(self) -> int:  # padded
        return self.mask.shape[1]

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """This group's keys or values from one layer's paged ``cache`` [blocks, block, heads,
        dim] as ``[rows, kv, heads, dim]``. Whole blocks: one contiguous row of ``block x
        heads x dim`` per block instead of one per token, which ``index_select`` copies several
        times faster on a CPU."""
        rows, blocks = self.blocks.shape
        return cache.index_select(0, self.blocks.reshape(-1)).view(
            rows, blocks * cache.shape[1], *cache.shape[2:])

    def window_mask(self, window: int | None) -> torch.Tensor:
        """``mask`` with the keys at or before ``query_pos - window`` hidden too."""
        if window is None:
            return self.mask
        assert self.query_pos is not None and self.kv_start is not None
        key_pos = self.kv_start[:, None] + torch.arange(self.kv_len, device=self.mask.device)
        return self.mask & (key_pos > self.query_pos[:, None] - window)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[self.token_start:self.token_end] if self.rows is None else tensor[self.rows]

    def put(self, target: torch.Tensor, value: torch.Tensor) -> None:
        if self.rows is None:
            target[self.token_start:self.token_end] = value
        else:
            target[self.rows] = value

    def row_tiles(self, max_rows: int) -> list[_DecodeGroup]:
        """This group cut into groups of at most ``max_rows`` rows (views, no copies)."""
        if self.num_rows <= max_rows:
            return [self]
        tiles = []
        for start, end in spans(0, self.num_rows, max_rows):
            positions = {name: None if value is None else value[start:end] for name, value
                         in (("query_pos", self.query_pos), ("kv_start", self.kv_start))}
            if self.rows is None:
                tiles.append(_DecodeGroup(self.blocks[start:end], self.mask[start:end],
                                          self.token_start + start, self.token_start + end,
                                          **positions))
            else:
                tiles.append(_DecodeGroup(self.blocks[start:end], self.mask[start:end], 0, 0,
                                          rows=self.rows[start:end], **positions))
        return tiles


@dataclass(frozen=True)
class _Prefill:
    """One sequence's prefill chunk: its queries are tokens ``token_start:token_end``; its keys
    are the ``kv_len`` cache slots from absolute position ``kv_start`` on."""

    slots: torch.Tensor  # [kv_len] flat cache slots to read
    token_start: int
    token_end: int
    query_start: int  # absolute position of the first query
    kv_start: int  # absolute position of the first key (a KVP shard's start)

    @property
    def kv_len(self) -> int:
        return self.slots.shape[0]

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """``[kv, heads, dim]``: ``index_select`` on the flattened slots is 7-13x faster on CPU
        than advanced indexing (measured for 32-150 decodes of 600 KV tokens)."""
        return cache.view(-1, *cache.shape[2:]).index_select(0, self.slots)

    def tiles(self, max_rows: int) -> list[QueryTile]:
        return query_tiles(self.token_end - self.token_start, self.query_start,
                           self.kv_start, self.kv_len, max_rows)


# A decode starts a new group when padding it to the group's longest KV would more than double
# its work and waste at least this many KV tokens; below that one more gather costs more.
MIN_DECODE_SPLIT_TOKENS = 256


def decode_groups(kv_lens: list[int] | tuple[int, ...]) -> list[list[int]]:
    """Split decode rows into groups whose KV lengths are within 2x of the group's longest."""
    order = sorted(range(len(kv_lens)), key=lambda i: kv_lens[i], reverse=True)
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row in order:
        kv = kv_lens[row]
        if current and 2 * kv < longest and longest - kv >= MIN_DECODE_SPLIT_TOKENS:
            groups.append(current)
            current = []
        if not current:
            longest = kv
        current.append(row)
    if current:
        groups.append(current)
    return groups


# The C++ kernel's longest context (kDirectTokens in cpu_decode_attention.cpp).
DIRECT_DECODE_TOKENS = 4096


def _plain_decodes(metadata: AttentionMetadata) -> bool:
    """Whether every decode row attends to exactly its first kv_len cached tokens, all before
    or at its query, within the C++ kernel's reach: not a KV-parallel shard, which starts
    elsewhere or lies partly after the query."""
    if metadata.block_tables.device.type != "cpu":
        return False
    for row in range(metadata.num_decodes):
        kv_len = metadata.kv_lens[row]
        if not (1 <= kv_len <= DIRECT_DECODE_TOKENS and metadata.kv_start_pos[row] == 0
                and metadata.query_start_pos[row] == kv_len - 1):
            return False
    return True


def _slots(block_table: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    offsets = torch.arange(kv_len, device=block_table.device)
    return block_table[..., offsets // block_size] * block_size + offsets % block_size


class TorchReferenceBackend:
    """The attention backend of the CPU engine. ``max_score_elements`` bounds every call's
    tile (module docstring); tests pass a small one so that short sequences span many tiles."""

    name = "torch"

    def __init__(self, max_score_elements: int = MAX_SCORE_ELEMENTS) -> None:
        if max_score_elements < 1:
            raise ValueError("max_score_elements must be positive")
        self.max_score_elements = max_score_elements
        self._metadata: AttentionMetadata | None = None
        self._decodes: list[_DecodeGroup] = []
        self._prefills: list[_Prefill] = []
        self._write_slots: torch.Tensor | None = None
        self._write_rows: torch.Tensor | None = None  # rows to store, when not every row
        # Set by the model runner when its engine compiled its decode steps, and so built
        # the C++ decode attention kernel (kernels/cpu_decode_attention.cpp): plain decodes
        # of float32 layers then attend in it (attend_decodes), reading the cache in place,
        # instead of gathering it for SDPA.
        self.direct_decodes = False
        self._direct: tuple[torch.Tensor, torch.Tensor] | None = None  # block tables, kv_lens

    def plan(self, metadata: AttentionMetadata) -> None:
        self._metadata = metadata
        self._plan_writes(metadata)
        self._decodes = []
        self._prefills = []
        self._direct = None
        num_decodes = metadata.num_decodes
        if num_decodes and self.direct_decodes and _plain_decodes(metadata):
            kv_lens = metadata.kv_lens[:num_decodes]
            blocks = -(-max(kv_lens) // metadata.block_size)
            self._direct = (metadata.block_tables[:num_decodes, :blocks],
                            torch.tensor(kv_lens, dtype=torch.int64))
        if num_decodes:
            groups = decode_groups(metadata.kv_lens[:num_decodes])
            for group in groups:
                rows = None if len(groups) == 1 else sorted(group)
                self._decodes.append(self._decode_plan(metadata, rows or list(range(num_decodes)),
                                                       contiguous=rows is None))
        token = num_decodes
        for seq in range(num_decodes, metadata.num_seqs):
            query_len = metadata.query_lens[seq]
            slots = _slots(metadata.block_tables[seq], metadata.kv_lens[seq], metadata.block_size)
            self._prefills.append(_Prefill(slots, token, token + query_len,
                                           metadata.query_start_pos[seq],
                                           metadata.kv_start_pos[seq]))
            token += query_len

    def _plan_writes(self, metadata: AttentionMetadata) -> None:
        """Which rows write_kv stores is the same in every layer: decided once per step, from
        the host-side count of skipped slots, so the step never waits on the device for it."""
        slots = metadata.slot_mapping
        skipped = metadata.skipped_writes
        if skipped is None:  # metadata built by hand, without the count: one device read
            skipped = int((slots < 0).sum())
        if skipped == 0:
            self._write_slots, self._write_rows = slots, None
            return
        # A stable sort puts the kept rows first, in order; their number is known on the host.
        kept = torch.argsort((slots < 0).to(torch.int8), stable=True)[:slots.shape[0] - skipped]
        self._write_slots, self._write_rows = slots.index_select(0, kept), kept

    @staticmethod
    def _decode_plan(metadata: AttentionMetadata, rows: list[int],
                     contiguous: bool) -> _DecodeGroup:
        device = metadata.block_tables.device
        kv_lens_list = [metadata.kv_lens[row] for row in rows]
        num_blocks = -(-max(kv_lens_list) // metadata.block_size)
        index = torch.tensor(rows, device=device)
        blocks = metadata.block_tables[index, :num_blocks]
        if blocks.shape[1] < num_blocks:  # never: every table covers its own KV
            raise ValueError("a decode's block table is shorter than its KV")
        kv_index = torch.arange(num_blocks * metadata.block_size, device=device)
        kv_lens = torch.tensor(kv_lens_list, device=device)
        kv_start = torch.tensor([metadata.kv_start_pos[row] for row in rows], device=device)
        query_pos = torch.tensor([metadata.query_start_pos[row] for row in rows], device=device)
        mask = (kv_index[None, :] < kv_lens[:, None]) & (
            kv_start[:, None] + kv_index[None, :] <= query_pos[:, None])
        if contiguous:
            return _DecodeGroup(blocks, mask, rows[0], rows[-1] + 1, query_pos=query_pos,
                                kv_start=kv_start)
        return _DecodeGroup(blocks, mask, 0, 0, rows=index, query_pos=query_pos,
                            kv_start=kv_start)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor) -> None:
        self._require_plan()
        slots, rows = self._write_slots, self._write_rows
        assert slots is not None, "plan() sets the write slots"
        if rows is not None:
            key, value = key.index_select(0, rows), value.index_select(0, rows)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float, return_lse: bool = True, sliding_window: int | None = None,
            logit_softcap: float | None = None) -> AttentionResult:
        self._require_plan()
        options = _LayerOptions(sliding_window, logit_softcap)
        if not return_lse and options.plain:
            return AttentionResult(output=self._run_fused(query, k_cache, v_cache, scale),
                                   lse_natural=None)
        # SDPA has no soft-cap: such layers, and sliding ones, take the log-sum-exp path.
        # Rows that see no key (a KVP shard wholly after them, an empty shard) keep these.
        output = torch.zeros_like(query)
        lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32,
                         device=query.device)
        for group in self._decodes:
            self._decode_with_lse(group, query, k_cache, v_cache, scale, output, lse, options)
        for plan in self._prefills:
            self._prefill_with_lse(plan, query, k_cache, v_cache, scale, output, lse, options)
        return AttentionResult(output=output, lse_natural=lse if return_lse else None)

    def _decode_with_lse(self, group: _DecodeGroup, query: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, scale: float, output: torch.Tensor,
                         lse: torch.Tensor, options: _LayerOptions) -> None:
        _, num_heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        if group.kv_len == 0:
            return
        for tile in group.row_tiles(rows_per_tile(self.max_score_elements, num_heads,
                                                  group.kv_len)):
            rows = tile.num_rows
            # [rows, kv_heads, group, 1, dim] x [rows, kv_heads, 1, dim, kv] -> scores per head
            q = tile.take(query).view(rows, kv_heads, num_heads // kv_heads, 1, head_dim)
            keys = tile.gather(k_cache).permute(0, 2, 3, 1).unsqueeze(2)
            values = tile.gather(v_cache).permute(0, 2, 1, 3).unsqueeze(2)
            mask = tile.window_mask(options.sliding_window)[:, None, None, None, :]
            # Only a single row whose KV alone exceeds the bound needs key tiles.
            key_tile = max(1, self.max_score_elements // (num_heads * rows))
            out, row_lse = attend_in_key_tiles(q, keys, values, scale,
                                               spans(0, tile.kv_len, key_tile),
                                               lambda start, end: mask[..., start:end],
                                               options.logit_softcap)
            tile.put(output, out.reshape(rows, num_heads, head_dim).to(query.dtype))
            tile.put(lse, row_lse.reshape(rows, num_heads))

    def _prefill_with_lse(self, plan: _Prefill, query: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, scale: float, output: torch.Tensor,
                          lse: torch.Tensor, options: _LayerOptions) -> None:
        _, num_heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        q_len = plan.token_end - plan.token_start
        # [kv_heads, group, q, dim] x keys [kv_heads, 1, dim, kv], values [kv_heads, 1, kv, dim]
        queries = query[plan.token_start:plan.token_end].view(
            q_len, kv_heads, num_heads // kv_heads, head_dim).permute(1, 2, 0, 3)
        keys = plan.gather(k_cache).permute(1, 2, 0).unsqueeze(1)
        values = plan.gather(v_cache).permute(1, 0, 2).unsqueeze(1)
        max_rows, key_tile = lse_tile_sizes(self.max_score_elements, num_heads, q_len,
                                            plan.kv_len)
        for tile in plan.tiles(max_rows):
            shared, visible = tile.shared_keys, tile.visible_keys
            window = options.sliding_window
            mask_of: Callable[[int, int], torch.Tensor | None] = partial(
                _band_mask, tile, device=query.device)
            if window is not None:
                # Keys before the first row's window are no row's; the rest take a full mask.
                first = max(0, plan.query_start + tile.row_start - window + 1 - plan.kv_start)
                if first >= visible:
                    continue
                key_spans = spans(first, visible, key_tile)
                mask_of = partial(_window_mask, plan, tile, window, device=query.device)
            # Keys that take several tiles are cut at the shared keys' end, so that only the
            # diagonal band's tiles build a mask; keys that fit one tile take one pass.
            elif visible <= key_tile:
                key_spans = spans(0, visible, key_tile)
            else:
                key_spans = spans(0, shared, key_tile) + spans(shared, visible, key_tile)
            out, row_lse = attend_in_key_tiles(
                queries[:, :, tile.row_start:tile.row_end], keys, values, scale, key_spans,
                mask_of, options.logit_softcap)
            rows = slice(plan.token_start + tile.row_start, plan.token_start + tile.row_end)
            output[rows] = out.permute(2, 0, 1, 3).reshape(tile.num_rows, num_heads,
                                                           head_dim).to(query.dtype)
            lse[rows] = row_lse.permute(2, 0, 1).reshape(tile.num_rows, num_heads)

    def _run_fused(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   scale: float) -> torch.Tensor:
        """The same attention through torch's fused SDPA kernels, without the LSE."""
        output = torch.zeros_like(query)  # rows that see no key stay zero, as with the LSE
        num_heads = query.shape[1]
        decodes = self._decodes
        if self._direct is not None and query.dtype == k_cache.dtype == torch.float32:
            tables, kv_lens = self._direct
            rows = tables.shape[0]
            output[:rows] = torch.ops.slipstream_cpu.attend_decodes(
                query[:rows], k_cache, v_cache, tables, kv_lens, scale)
            decodes = []
        for group in decodes:
            if group.kv_len == 0:
                continue
            for tile in group.row_tiles(rows_per_tile(self.max_score_elements, num_heads,
                                                      group.kv_len)):
                q = tile.take(query).unsqueeze(2)  # [rows, heads, 1, dim]
                keys = tile.gather(k_cache).transpose(1, 2)  # [rows, kv_heads, kv, dim]
                values = tile.gather(v_cache).transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=tile.mask[:, None, None, :], scale=scale,
                    enable_gqa=True)
                tile.put(output, out.squeeze(2))
        for plan in self._prefills:
            self._prefill_fused(plan, query, k_cache, v_cache, scale, output)
        return output

    def _prefill_fused(self, plan: _Prefill, query: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, scale: float, output: torch.Tensor) -> None:
        """One SDPA call per query tile, over the keys up to the tile's last query. Keys the
        whole tile sees need no mask: a tile wholly after its keys runs unmasked, the first
        tile of a fresh prompt as SDPA's own causal mask, the others with an additive mask."""
        # [1, heads, q, dim] and [1, kv_heads, kv, dim]
        queries = query[plan.token_start:plan.token_end].transpose(0, 1).unsqueeze(0)
        keys = plan.gather(k_cache).transpose(0, 1).unsqueeze(0)
        values = plan.gather(v_cache).transpose(0, 1).unsqueeze(0)
        max_rows = rows_per_tile(self.max_score_elements, query.shape[1], plan.kv_len)
        for tile in plan.tiles(max_rows):
            visible = slice(0, tile.visible_keys)
            mask, causal = fused_tile_mask(tile, query.dtype, query.device)
            out = F.scaled_dot_product_attention(
                queries[:, :, tile.row_start:tile.row_end], keys[:, :, visible],
                values[:, :, visible], attn_mask=mask, is_causal=causal, scale=scale,
                enable_gqa=True)
            output[plan.token_start + tile.row_start:plan.token_start + tile.row_end] = (
                out.squeeze(0).transpose(0, 1))

    def _require_plan(self) -> AttentionMetadata:
        if self._metadata is None:
            raise RuntimeError("plan() must be called once per step before write_kv()/run()")
        return self._metadata


@dataclass(frozen=True)
class _LayerOptions:
    sliding_window: int | None
    logit_softcap: float | None

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.logit_softcap is None


def _window_mask(plan: _Prefill, tile: QueryTile, window: int, start: int, end: int,
                 device: torch.device) -> torch.Tensor:
    """Which of keys ``start:end`` each row of a tile sees in a sliding-window layer: those
    at or before its position and after its position minus ``window``."""
    query_pos = plan.query_start + torch.arange(tile.row_start, tile.row_end, device=device)
    key_pos = plan.kv_start + torch.arange(start, end, device=device)
    age = query_pos[:, None] - key_pos[None, :]
    return (age >= 0) & (age < window)


def _band_mask(tile: QueryTile, start: int, end: int,
               device: torch.device) -> torch.Tensor | None:
    """The mask of keys ``start:end`` for a query tile: None within its shared keys. Row ``i``
    sees key ``j`` iff ``j - shared_keys < i``, which holds for every shared key."""
    if end <= tile.shared_keys:
        return None
    return band_visible(tile.num_rows, start - tile.shared_keys, end - tile.shared_keys, device)
