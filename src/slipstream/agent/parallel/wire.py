"""What crosses from the controller to the workers each step: the batch as a diff.

The scheduler's ``Batch`` gives every chunk its request's whole block table. Sent as is, a
request with a 1M-token context would put 65,536 block ids on the wire to every rank on every
step. Instead the workers keep each running request's table and its sampling options, and
the controller sends what changed (vLLM v1 does the same with its cached-request deltas):

- a request the workers do not know yet, or whose table no longer extends the one they hold
  (it was preempted and re-allocated), goes in full: its whole table and its sampling
  options (``WireChunk.sampling`` set);
- a running request sends only its new tokens, its position and the block ids appended since
  its last step (none on most decode steps);
- requests that left the engine are listed once in ``WireBatch.released``; the workers drop
  them before applying the chunks;
- a request with presence, frequency or repetition penalties carries the tokens they count
  (``ScheduledChunk.history``) on each sampling chunk, in full: the one per-step cost that
  grows with its length, paid only by requests that ask for penalties;
- a batch with rows under a grammar is marked (``WireBatch.masked``): its masks follow in a
  message of their own (``WireMasks``), to the sampler rank only, sent while the workers
  already run the forward (the controller computes them then), and the sampler rank waits
  for them only when its logits are ready.

``BatchDiffer`` (controller) and ``WorkerTables`` (every worker) are the two ends; feeding
``BatchDiffer.diff`` into ``WorkerTables.apply`` gives back the scheduler's batch exactly
(tests/unit/test_parallel_wire.py checks that and that the bytes per step of a running
request do not grow with its context). Batches must reach the workers in the order they were
diffed, which the transport guarantees (one connection per worker, batches run in order).

The controller compares each table with the one it last sent (a C-level tuple comparison, the
same order of cost as the scheduler building the table tuple), so a re-allocated table can
never be mistaken for a grown one.
"""

from __future__ import annotations

from collections.abc import Collection

import msgspec

from slipstream.agent.scheduler.batch import Batch, BlockCopy, ScheduledChunk
from slipstream.contracts.sampling import SamplingOptions


class WireChunk(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    new_block_ids: tuple[int, ...]  # appended to the held table; the whole table when full
    sample: bool
    num_generated: int
    sampling: SamplingOptions | None = None  # set: the request is sent in full (new or reset)
    history: tuple[int, ...] = ()  # ScheduledChunk.history: only for requests with penalties


class WireBatch(msgspec.Struct, array_like=True, frozen=True):
    chunks: tuple[WireChunk, ...]
    released: tuple[str, ...] = ()
    swap_out: tuple[BlockCopy, ...] = ()
    swap_in: tuple[BlockCopy, ...] = ()
    masked: bool = False  # a MASKS message for this batch follows, to the sampler rank


class WireMasks(msgspec.Struct, array_like=True, frozen=True):
    """The header of a step's grammar masks (``sampler.GrammarMasks``); the int32 bitmask
    ``[len(rows), words]`` travels as a raw frame after it (``transport.encode_masks``)."""

    rows: tuple[int, ...]  # sampler rows (places among the batch's sampling chunks)
    words: int
    dead_rows: tuple[int, ...] = ()  # rows whose grammar failed: they fail alone


class BatchDiffer:
    """The controller's record of what the workers hold, and the diff against it."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[int, ...]] = {}
        self._sampling: dict[str, SamplingOptions] = {}
        self._released: list[str] = []

    @property
    def num_known(self) -> int:
        return len(self._tables)

    def release(self, request_ids: Collection[str]) -> None:
        """These requests left the engine: tell the workers with the next batch."""
        for request_id in request_ids:
            if self._tables.pop(request_id, None) is not None:
                del self._sampling[request_id]
                self._released.append(request_id)

    def diff(self, batch: Batch, masked: bool = False) -> WireBatch:
        chunks = []
        tables, sampling = self._tables, self._sampling
        for chunk in batch.chunks:
            request_id, table = chunk.request_id, chunk.block_ids
            held = tables.get(request_id)
            if (held is not None and len(table) >= len(held)
                    and sampling[request_id] == chunk.sampling
                    and table[:len(held)] == held):
                new_blocks, full = table[len(held):], None
            else:
                new_blocks, full = table, chunk.sampling
                sampling[request_id] = chunk.sampling
            tables[request_id] = table
            chunks.append(WireChunk(request_id, chunk.token_ids, chunk.start_pos, new_blocks,
                                    chunk.sample, chunk.num_generated, full, chunk.history))
        released, self._released = tuple(self._released), []
        return WireBatch(tuple(chunks), released, batch.swap_out, batch.swap_in, masked)


class WorkerTables:
    """A worker's copy of each running request's block table and sampling options."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}
        self._sampling: dict[str, SamplingOptions] = {}

    @property
    def num_known(self) -> int:
        return len(self._tables)

    def apply(self, wire: WireBatch) -> Batch:
        """The scheduler's batch again, from a diff; raises KeyError on a diff for a request
        this worker never saw (the controller and the worker disagree: a bug, not load)."""
        tables, sampling = self._tables, self._sampling
        for request_id in wire.released:
            tables.pop(request_id, None)
            sampling.pop(request_id, None)
        chunks = []
        for chunk in wire.chunks:
            request_id = chunk.request_id
            if chunk.sampling is not None:
                table = tables[request_id] = list(chunk.new_block_ids)
                sampling[request_id] = chunk.sampling
            else:
                table = tables[request_id]
                table.extend(chunk.new_block_ids)
            chunks.append(ScheduledChunk(request_id, chunk.token_ids, chunk.start_pos,
                                         tuple(table), chunk.sample, sampling[request_id],
                                         chunk.num_generated, chunk.history))
        return Batch(chunks=tuple(chunks), swap_out=wire.swap_out, swap_in=wire.swap_in)
