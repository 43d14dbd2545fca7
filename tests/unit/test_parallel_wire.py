"""The controller-to-worker batch diff (agent/parallel/wire.py): the workers rebuild exactly the
scheduler's batches, and what a running request costs on the wire per step does not grow with
its context."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.agent.engine.sampling.sampler import GrammarMasks, grammar_penalty
from slipstream.agent.parallel.transport import (
    decode_batch, decode_masks, encode_batch, encode_masks)
from slipstream.agent.parallel.wire import BatchDiffer, WorkerTables
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.sampling import SamplingOptions
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE

GREEDY = SamplingOptions(temperature=0.0)


def _wire_round_trip(differ: BatchDiffer, tables: WorkerTables, batch: Batch) -> tuple[Batch, int]:
    frames = encode_batch(7, differ.diff(batch))
    seq, wire = decode_batch(frames)
    assert seq == 7
    return tables.apply(wire), sum(len(frame) for frame in frames)


def _decode_bytes_per_step(context_tokens: int, steps: int = 40) -> list[int]:
    """Bytes of each step of one request decoding from a ``context_tokens`` context."""
    differ, tables = BatchDiffer(), WorkerTables()
    table = list(range(-(-context_tokens // BLOCK_SIZE)))
    sizes = []
    for step in range(steps):
        pos = context_tokens + step
        if pos // BLOCK_SIZE >= len(table):
            table.append(len(table))  # a new block every BLOCK_SIZE tokens
        chunk = ScheduledChunk("cmpl-" + "a" * 32, (1000 + step,), pos, tuple(table), True,
                               GREEDY, step)
        rebuilt, size = _wire_round_trip(differ, tables, Batch(chunks=(chunk,)))
        assert rebuilt.chunks == (chunk,)
        sizes.append(size)
    return sizes


def test_bytes_per_decode_step_do_not_grow_with_context():
    short = _decode_bytes_per_step(1024)
    long = _decode_bytes_per_step(1 << 20)  # 65,536 blocks
    # The first step sends the whole table: that one grows with the context ...
    assert long[0] > 65_536 > short[0]
    # ... and every later one is a constant that does not depend on it: a block id more on
    # the steps that cross into a new block, nothing else.
    steady_short, steady_long = short[1:], long[1:]
    assert max(steady_long) <= max(steady_short) + 8
    assert max(steady_long) < 100, steady_long
    assert max(steady_long) - min(steady_long) <= 8


def test_random_batches_rebuild_exactly_through_preemption_and_release():
    """Requests start, grow, get preempted (re-allocated tables), leave and come back under the
    same id; the worker's view always equals the scheduler's batch."""
    rng = random.Random(16)
    differ, tables = BatchDiffer(), WorkerTables()
    live: dict[str, list[int]] = {}
    next_block = 0
    for _ in range(400):
        # Some requests leave (finished / aborted) ...
        for request_id in [rid for rid in live if rng.random() < 0.08]:
            del live[request_id]
            differ.release([request_id])
        # ... some are preempted and come back with a fresh table ...
        for request_id in [rid for rid in live if rng.random() < 0.05]:
            live[request_id] = [next_block + i for i in range(len(live[request_id]))]
            next_block += len(live[request_id])
        # ... new ones arrive (ids reused now and then), and the rest grow.
        if rng.random() < 0.5:
            live[f"req-{rng.randrange(30)}"] = []
        chunks = []
        for request_id, table in live.items():
            if rng.random() < 0.3:
                continue  # not scheduled this step
            for _ in range(rng.choice((0, 0, 0, 1, 2))):
                table.append(next_block)
                next_block += 1
            options = SamplingOptions(temperature=rng.choice((0.0, 0.7)), seed=len(request_id))
            chunks.append(ScheduledChunk(request_id, tuple(rng.randrange(4000) for _ in range(3)),
                                         rng.randrange(1000), tuple(table), rng.random() < 0.5,
                                         options, rng.randrange(50)))
        batch = Batch(chunks=tuple(chunks))
        rebuilt, _ = _wire_round_trip(differ, tables, batch)
        assert rebuilt.chunks == batch.chunks
        assert tables.num_known == differ.num_known


def test_a_table_that_was_replaced_is_sent_in_full():
    differ = BatchDiffer()
    first = ScheduledChunk("r", (1,), 0, (4, 5, 6), True, GREEDY)
    assert differ.diff(Batch(chunks=(first,))).chunks[0].sampling == GREEDY
    grown = ScheduledChunk("r", (2,), 1, (4, 5, 6, 9), True, GREEDY, 1)
    wire = differ.diff(Batch(chunks=(grown,))).chunks[0]
    assert wire.new_block_ids == (9,) and wire.sampling is None
    # Preempted and re-allocated: the same length, different ids -> the whole table again.
    moved = ScheduledChunk("r", (1,), 0, (4, 7, 6, 9), True, GREEDY)
    wire = differ.diff(Batch(chunks=(moved,))).chunks[0]
    assert wire.new_block_ids == (4, 7, 6, 9) and wire.sampling == GREEDY
    differ.release(["r", "never-seen"])
    assert differ.diff(Batch(chunks=())).released == ("r",)


def test_penalties_sampling_options_and_history_cross_the_wire():
    differ, tables = BatchDiffer(), WorkerTables()
    options = SamplingOptions(temperature=0.7, presence_penalty=0.5, frequency_penalty=-1.0,
                              repetition_penalty=1.2, logit_bias=((5, -100.0), (9, 3.5)))
    for step in range(3):
        chunk = ScheduledChunk("req", (40 + step,), 10 + step, (0,), True, options, step,
                               history=tuple(range(10 + step)))
        rebuilt, _ = _wire_round_trip(differ, tables, Batch(chunks=(chunk,)))
        assert rebuilt.chunks == (chunk,)


def test_a_batch_with_guided_rows_is_marked_for_its_masks():
    differ, tables = BatchDiffer(), WorkerTables()
    chunk = ScheduledChunk("g", (1, 2), 0, (3,), True, SamplingOptions(guided=True))
    _, plain = decode_batch(encode_batch(1, differ.diff(Batch(chunks=(chunk,)))))
    _, masked = decode_batch(encode_batch(2, differ.diff(Batch(chunks=(chunk,)), masked=True)))
    assert not plain.masked and masked.masked
    tables.apply(plain)
    assert tables.apply(masked).chunks[0].sampling.guided


def test_grammar_masks_cross_bit_for_bit():
    generator = torch.Generator().manual_seed(18)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=generator)
    bits[1] = -1  # every token allowed
    bits[2, :2] = 0  # none of the first 64
    seq, back = decode_masks(encode_masks(9, GrammarMasks(rows=[0, 2, 5], allowed=bits,
                                                          dead_rows=[2])))
    assert seq == 9 and back.rows == [0, 2, 5] and back.dead_rows == [2]
    assert back.allowed.dtype == torch.int32 and torch.equal(back.allowed, bits)
    assert torch.equal(grammar_penalty(back.allowed, 150), grammar_penalty(bits, 150))
    back.allowed[0, 0] = 0  # the sampler's own copy, not a view of the message
    # No masked row, only failed ones (what the controller sends when the masks failed).
    seq, dead = decode_masks(encode_masks(4, GrammarMasks(
        rows=[], allowed=torch.empty(0, 0, dtype=torch.int32), dead_rows=[1, 3])))
    assert seq == 4 and dead.rows == [] and dead.dead_rows == [1, 3]
    assert dead.allowed.shape == (0, 0)
    with pytest.raises(TypeError, match="int32 bitmask"):
        encode_masks(1, GrammarMasks(rows=[0], allowed=torch.ones(1, 10, dtype=torch.bool)))
