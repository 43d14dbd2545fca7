"""Short-prefill bucket config and selection: which (length, batch) bucket a batch runs in."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.config import EngineConfig, ShortPrefillBuckets
from slipstream.agent.engine.step.prefill_buckets import (
    PrefillBucket, all_buckets, select_bucket, short_prefill_lengths)
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.scheduler.batch import ScheduledChunk

GRID = all_buckets(ShortPrefillBuckets())
NO_CAP = 1e9


def prompt(length: int, start_pos: int = 0, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk("r", tuple(range(length)), start_pos, (0,) * 40, sample)


def test_default_grid_is_pla_serve_style_powers_of_two():
    config = ShortPrefillBuckets()
    assert config.lengths_tokens == (32, 64, 128, 256, 512)
    assert config.batch_sizes == (1, 2, 4, 8, 16)
    assert len(GRID) == config.num_buckets == 25


@pytest.mark.parametrize(("lengths", "expected"), [
    ([1], PrefillBucket(32, 1)),
    ([32], PrefillBucket(32, 1)),
    ([33], PrefillBucket(64, 1)),
    ([5, 9, 30], PrefillBucket(32, 4)),
    ([100] * 8, PrefillBucket(128, 8)),
    ([512] * 16, PrefillBucket(512, 16)),
    ([3] * 9, PrefillBucket(32, 16)),
])
def test_the_smallest_bucket_that_holds_every_prompt_is_picked(lengths, expected):
    assert select_bucket(GRID, lengths, NO_CAP) == expected


@pytest.mark.parametrize("lengths", [[513], [10] * 17, []])
def test_a_batch_that_fits_no_bucket_gets_none(lengths):
    assert select_bucket(GRID, lengths, NO_CAP) is None


def test_padding_cap_sends_a_mostly_padding_batch_to_the_eager_path():
    # One 300-token prompt among seven 1-token ones: bucket (512, 8) = 4096 slots for 307.
    lengths = [300] + [1] * 7
    assert select_bucket(GRID, lengths, NO_CAP) == PrefillBucket(512, 8)
    assert select_bucket(GRID, lengths, max_padding_factor=4.0) is None
    assert select_bucket(GRID, [120] * 7, max_padding_factor=4.0) == PrefillBucket(128, 8)


def test_selection_over_a_ragged_set_minimises_padded_tokens():
    candidates = [PrefillBucket(64, 4), PrefillBucket(128, 1), PrefillBucket(32, 16)]
    assert select_bucket(candidates, [20, 20], NO_CAP) == PrefillBucket(64, 4)
    assert select_bucket(candidates, [100], NO_CAP) == PrefillBucket(128, 1)


def test_only_batches_of_whole_fresh_prompts_are_short_prefills():
    assert short_prefill_lengths([prompt(5), prompt(17)]) == [5, 17]
    assert short_prefill_lengths([prompt(5), prompt(1, start_pos=9)]) is None  # a decode
    assert short_prefill_lengths([prompt(40, start_pos=64)]) is None  # over cached KV
    assert short_prefill_lengths([prompt(64, sample=False)]) is None  # first chunk of many
    assert short_prefill_lengths([]) is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lengths_tokens": ()}, "must not be empty"),
    ({"lengths_tokens": (64, 32)}, "strictly increasing"),
    ({"batch_sizes": (1, 1, 2)}, "strictly increasing"),
    ({"batch_sizes": (0, 2)}, "positive integers"),
    ({"max_padding_factor": 0.5}, "at least 1"),
])
def test_invalid_bucket_configs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShortPrefillBuckets(**kwargs)


def test_cuda_graphs_are_refused_with_parallel_workers(tmp_path):
    with pytest.raises(ValueError, match="single process"):
        EngineConfig(model_dir=tmp_path, cuda_graphs=True, parallel=ParallelConfig(tp=2))
    with pytest.raises(ValueError, match="single process"):
        EngineConfig(model_dir=tmp_path, short_prefill_graphs=True,
                     parallel=ParallelConfig(tp=2))
    assert EngineConfig(model_dir=tmp_path, cuda_graphs=True).cuda_graphs
    assert EngineConfig(model_dir=tmp_path, parallel=ParallelConfig(tp=2)).cuda_graphs is None
