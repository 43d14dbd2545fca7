"""Our attention metadata -> FlashInfer's paged-KV launch descriptions (index math only).

Data flow::

    AttentionMetadata  --plan_launches()-->  StepLaunches (up to three PagedLaunch)
    FlashInferBackend.plan() keeps the StepLaunches; every layer's run() feeds each launch's
    CSR tensors to a FlashInfer wrapper.

This module never imports flashinfer, so the mapping can be checked on a CPU.

Masking. Our rule (see ``torch_ref``): the query at absolute position ``p`` sees KV index ``j``
of the shard iff ``kv_start_pos + j <= p``. FlashInfer's causal rule puts a request's queries
at the *end* of its KV: query row ``i`` of ``q_len`` sees KV index ``j`` of ``kv_len`` iff
``j <= i + kv_len - q_len``. For an unsharded sequence (``kv_start_pos = 0``, ``kv_len =
query_start_pos + q_len``) the two rules coincide. For a KV shard ``[s, s + L)`` they do not in
general, so each sequence's query rows are split by position into up to three segments:

* ``p < s`` -- the shard lies entirely after the query: nothing is visible. No launch covers
  these rows; the backend writes zero output and ``lse = -inf`` as the spec requires.
* ``s <= p < s + L`` -- the causal band. Row ``p`` sees the shard's prefix ``[0, p - s]``.
  Handing FlashInfer only the prefix up to the band's last query, ``kv_len = p_last - s + 1``,
  puts that query at the end of the KV, and FlashInfer's rule becomes exactly ours.
* ``p >= s + L`` -- the shard lies entirely before the query, so causal masking removes nothing
  and a non-causal launch over the whole shard is the same computation. FlashInfer's causal
  rule cannot say this (it would hide the shard's tail from the earlier of these rows), hence
  a second prefill launch planned with ``causal=False``.

Decodes have one row, so band and "after" both become one decode request over the visible
prefix ``min(L, p - s + 1)``. Unsharded steps produce one decode launch and one causal
prefill launch, each over contiguous rows (no gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.kernels.attention import AttentionMetadata

INDEX_DTYPE = torch.int32  # FlashInfer's indptr/indices/last_page_len are int32


@dataclass(frozen=True)
class QuerySegment:
    """A run of one sequence's query rows that share one masking rule."""

    seq: int  # index into the metadata's sequences (selects the block table)
    first_row: int  # in the flat token dimension
    num_rows: int
    kv_len: int  # tokens of the shard's KV prefix the launch reads (>= 1)


@dataclass(frozen=True)
class PagedLaunch:
    """One FlashInfer wrapper call: requests in CSR form over the paged NHD cache."""

    rows: slice | torch.Tensor  # flat query rows this launch computes, in request order
    qo_indptr: torch.Tensor  # [requests + 1] int32, CPU: query rows per request
    kv_indptr: torch.Tensor  # [requests + 1] int32, CPU: pages per request
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, cache device: physical block ids
    kv_last_page_len: torch.Tensor  # [requests] int32, CPU: tokens in each last page, 1..block
    causal: bool

    @property
    def num_rows(self) -> int:
        return int(self.qo_indptr[-1])


@dataclass(frozen=True)
class StepLaunches:
    decode: PagedLaunch | None
    prefill_causal: PagedLaunch | None
    prefill_full: PagedLaunch | None  # rows whose shard lies wholly before them
    num_tokens: int
    rows_without_kv: int  # rows no launch covers: zero output, lse = -inf

    def launches(self) -> list[PagedLaunch]:
        return [launch for launch in (self.decode, self.prefill_causal, self.prefill_full)
                if launch is not None]


def split_sequence(seq: int, first_row: int, query_start: int, query_len: int,
                   kv_start: int, kv_len: int) -> tuple[QuerySegment | None, QuerySegment | None]:
    """(causal band, after-the-shard) segments of one sequence; rows before the shard get none."""
    kv_end = kv_start + kv_len  # exclusive
    query_end = query_start + query_len  # exclusive
    band_start, band_end = max(query_start, kv_start), min(query_end, kv_end)
    band = None
    if band_end > band_start:
        band = QuerySegment(seq, first_row + band_start - query_start, band_end - band_start,
                            kv_len=band_end - kv_start)
    after_start = max(query_start, kv_end)
    after = None
    if kv_len > 0 and query_end > after_start:
        after = QuerySegment(seq, first_row + after_start - query_start, query_end - after_start,
                             kv_len=kv_len)
    return band, after


def plan_launches(metadata: AttentionMetadata) -> StepLaunches:
    decode: list[QuerySegment] = []
    causal: list[QuerySegment] = []
    full: list[QuerySegment] = []
    row = 0
    for seq in range(metadata.num_seqs):
        band, after = split_sequence(
            seq, row, metadata.query_start_pos[seq], metadata.query_lens[seq],
            metadata.kv_start_pos[seq], metadata.kv_lens[seq])
        if seq < metadata.num_decodes:
            # One row: it is either in the band or after the shard; both read a prefix.
            decode.extend(segment for segment in (band, after) if segment is not None)
        else:
            causal.extend([band] if band is not None else [])
            full.extend([after] if after is not None else [])
        row += metadata.query_lens[seq]
    covered = sum(segment.num_rows for segment in decode + causal + full)
    return StepLaunches(
        decode=_build_launch(decode, metadata, causal=False),
        prefill_causal=_build_launch(causal, metadata, causal=True),
        prefill_full=_build_launch(full, metadata, causal=False),
        num_tokens=row,
        rows_without_kv=row - covered,
    )


def _build_launch(segments: list[QuerySegment], metadata: AttentionMetadata,
                  causal: bool) -> PagedLaunch | None:
    if not segments:
        return None
    block_size = metadata.block_size
    device = metadata.block_tables.device
    num_rows = torch.tensor([s.num_rows for s in segments], dtype=torch.int64)
    kv_lens = torch.tensor([s.kv_len for s in segments], dtype=torch.int64)
    num_pages = (kv_lens + block_size - 1) // block_size
    qo_indptr = _indptr(num_rows)
    kv_indptr = _indptr(num_pages)
    kv_last_page_len = kv_lens - (num_pages - 1) * block_size

    # Page p of request r is block_tables[seq_r, p]: one gather on the device, no host sync.
    seq_of_page = torch.repeat_interleave(
        torch.tensor([s.seq for s in segments], dtype=torch.int64), num_pages)
    page_in_seq = torch.arange(int(kv_indptr[-1])) - torch.repeat_interleave(
        kv_indptr[:-1].long(), num_pages)
    kv_indices = metadata.block_tables[seq_of_page.to(device), page_in_seq.to(device)]

    return PagedLaunch(
        rows=_rows(segments, qo_indptr, device),
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices.to(INDEX_DTYPE),
        kv_last_page_len=kv_last_page_len.to(INDEX_DTYPE),
        causal=causal,
    )


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(counts, dim=0, out=indptr[1:])
    return indptr.to(INDEX_DTYPE)


def _rows(segments: list[QuerySegment], qo_indptr: torch.Tensor,
          device: torch.device) -> slice | torch.Tensor:
    """A slice when the segments tile one contiguous range (the common, unsharded case)."""
    contiguous = all(later.first_row == earlier.first_row + earlier.num_rows
                     for earlier, later in zip(segments, segments[1:]))
    if contiguous:
        return slice(segments[0].first_row, segments[0].first_row + int(qo_indptr[-1]))
    num_rows = qo_indptr[1:].long() - qo_indptr[:-1].long()
    first_rows = torch.tensor([s.first_row for s in segments], dtype=torch.int64)
    offsets = torch.repeat_interleave(first_rows - qo_indptr[:-1].long(), num_rows)
    return (torch.arange(int(qo_indptr[-1])) + offsets).to(device)
