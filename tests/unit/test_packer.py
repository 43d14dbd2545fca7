"""The time-budget packer (Medha Algorithms 1-2) and the prefill time cache (Algorithm 3)."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.sim.datasets import H100_LLAMA3_8B_TP8_DIR
from slipstream.agent.scheduler.packer import FLOAT_SLACK, PackerConfig, PrefillBudget, largest_chunk_tokens
from slipstream.agent.scheduler.predictor import AnalyticModel, RuntimePredictor
from slipstream.agent.scheduler.prefill_time_cache import PrefillTimeCache
from slipstream.agent.scheduler.profile_table import VIDUR_H100_LLAMA3_8B_TP8


H100_DIR = H100_LLAMA3_8B_TP8_DIR


@functools.lru_cache(maxsize=1)
def h100() -> RuntimePredictor:
    return RuntimePredictor.from_directory(H100_DIR, meta=VIDUR_H100_LLAMA3_8B_TP8)


ANALYTIC = AnalyticModel(ms_per_token=0.02, ms_per_attended_pair=2e-7, ms_per_decode_kv_token=2e-5,
                         iteration_overhead_ms=1.0)

prefill_requests = st.lists(
    st.tuples(st.integers(0, 1_500_000), st.integers(1, 300_000), st.floats(-2.0, 3.0),
              st.one_of(st.none(), st.integers(0, 50_000))),
    min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(num_decodes=st.integers(0, 300), mean_kv=st.integers(1, 40_000), prefills=prefill_requests,
       target_ms=st.sampled_from([20.0, 50.0, 120.0]), use_h100=st.booleans())
def test_packer_never_exceeds_the_budget_by_its_own_prediction(num_decodes, mean_kv, prefills,
                                                                target_ms, use_h100):
    model = h100() if use_h100 else ANALYTIC
    config = PackerConfig(target_batch_time_ms=target_ms, long_request_threshold_tokens=200_000)
    budget = PrefillBudget(model, config)
    budget.add_decodes(num_decodes, num_decodes * mean_kv)
    decode_only_ms = budget.time_ms
    longs = 0
    for kv_before, remaining, slack, fit in prefills:
        was_empty = budget.is_empty
        minimum_ms = budget.estimate.time_with_prefill_ms(
            kv_before, min(remaining, fit if fit is not None else remaining,
                           config.min_chunk_tokens))
        size = budget.chunk_for(kv_before, remaining, slack, fit)
        assert 0 <= size <= remaining
        if fit is not None:
            assert size <= max(fit, 0)
        if size:
            assert size in (remaining, fit) or size % 32 == 0  # whole rest, memory room, or granule
            budget.add_prefill(kv_before, size)
            longs += budget.is_long(kv_before)
            if budget.time_ms > target_ms * (1 + FLOAT_SLACK):
                # The one exception: when even a minimum chunk is over budget and the batch
                # would otherwise be empty, a chunk costing up to one more target than the
                # minimum chunk runs (progress).
                assert was_empty
                assert budget.time_ms <= (minimum_ms + target_ms) * (1 + FLOAT_SLACK)
    if budget.num_prefills == 0:
        assert budget.time_ms == decode_only_ms
    assert longs <= 1


def test_an_otherwise_empty_batch_always_makes_progress():
    # Even one token is predicted at 40 ms, over the 20 ms target.
    model = AnalyticModel(ms_per_token=0.01, iteration_overhead_ms=40.0)
    config = PackerConfig(target_batch_time_ms=20.0)
    budget = PrefillBudget(model, config)
    # The fixed 40 ms dominates: the chunk may cost one more target (20 ms = 2,000 tokens)
    # than the minimum chunk, so the whole 1,000 tokens go at once.
    assert budget.chunk_for(0, 1000) == 1000
    assert budget.chunk_for(0, 5000) == 2016  # 40.32 + 20 ms: 2,032 tokens, in granules
    assert budget.chunk_for(0, 10) == 10
    assert budget.chunk_for(0, 1000, fit_tokens=16) == 16
    budget.add_prefill(0, config.min_chunk_tokens)
    assert budget.chunk_for(0, 1000) == 0  # only the first prefill is forced
    with_decodes = PrefillBudget(model, config)
    with_decodes.add_decodes(1, 100)
    assert with_decodes.chunk_for(0, 1000) == 0  # decodes progress; the budget holds


def test_binary_search_finds_the_largest_fitting_chunk():
    config = PackerConfig()
    for limit in (1, 31, 32, 33, 511, 512, 513, 700, 8191, 9000):
        size = largest_chunk_tokens(lambda c: c <= limit, 100_000, 100_000, config)
        expected = min(limit // 32 * 32, 8192)
        assert size == expected
    # A remainder that fits goes whole, whatever its granularity.
    assert largest_chunk_tokens(lambda c: c <= 100, 77, 10_000, config) == 77
    assert largest_chunk_tokens(lambda c: c <= 100, 10_000, 20, config) == 20


def test_nothing_is_added_once_the_batch_is_ninety_percent_full():
    model = AnalyticModel(ms_per_token=1.0)
    budget = PrefillBudget(model, PackerConfig(target_batch_time_ms=100.0))
    budget.add_decodes(91, 0)
    assert budget.exhausted
    assert budget.chunk_for(0, 5) == 0
    budget = PrefillBudget(model, PackerConfig(target_batch_time_ms=100.0))
    budget.add_decodes(89, 0)
    assert budget.chunk_for(0, 5) == 5


def test_at_most_one_long_prefill_per_batch():
    budget = PrefillBudget(ANALYTIC, PackerConfig(target_batch_time_ms=500.0,
                                                  long_request_threshold_tokens=10_000))
    first = budget.chunk_for(20_000, 50_000)
    budget.add_prefill(20_000, first)
    assert first > 0 and budget.has_long_prefill
    assert budget.chunk_for(30_000, 50_000) == 0
    assert budget.chunk_for(0, 1000) > 0  # short prefills still go in


def test_kvp_group_room_caps_the_chunk():
    config = PackerConfig(target_batch_time_ms=1000.0, kvp_tokens_per_group=4096)
    budget = PrefillBudget(AnalyticModel(ms_per_token=0.001), config)
    assert budget.chunk_for(4000, 100_000) == 96


def test_chunks_shrink_as_a_long_prefill_grows_with_h100_tables():
    config = PackerConfig(target_batch_time_ms=50.0)
    sizes = []
    for kv in (0, 16_384, 65_536, 262_144, 1_048_576):
        budget = PrefillBudget(h100(), config)
        sizes.append(budget.chunk_for(kv, 10_000_000))
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] >= 4 * sizes[-1] > 0


def test_space_sharing_leaves_room_that_short_prefills_use():
    config = PackerConfig(target_batch_time_ms=50.0, max_space_share_fraction=0.5)
    greedy = PrefillBudget(h100(), config)
    greedy.add_decodes(32, 32 * 4000)
    greedy.add_prefill(300_000, greedy.chunk_for(300_000, 700_000, relative_slack=0.0))
    assert greedy.chunk_for(0, 2000) == 0  # an urgent long prefill takes the whole batch

    sharing = PrefillBudget(h100(), config)
    sharing.add_decodes(32, 32 * 4000)
    long_chunk = sharing.chunk_for(300_000, 700_000, relative_slack=2.0)  # capped at 0.5
    sharing.add_prefill(300_000, long_chunk)
    assert 0 < long_chunk and sharing.time_ms <= 25.0 + 1e-6
    short_chunk = sharing.chunk_for(0, 2000)
    assert short_chunk >= 256
    sharing.add_prefill(0, short_chunk)
    assert sharing.time_ms <= 50.0 + 1e-6


def test_prefill_time_cache_matches_a_linear_model_and_divides_by_spp():
    model = AnalyticModel(ms_per_token=0.1)
    config = PackerConfig(target_batch_time_ms=50.0)
    cache = PrefillTimeCache(model, config)
    assert cache.total_s(10_000) == pytest.approx(1.0)
    assert cache.total_s(300) == pytest.approx(0.03)
    assert cache.remaining_s(10_000, 4_000) == pytest.approx(0.6)
    spp = PrefillTimeCache(model, config, spp_degree=4)
    assert spp.total_s(10_000) == pytest.approx(0.25)


def test_prefill_time_cache_with_h100_is_superlinear_and_monotone():
    cache = PrefillTimeCache(h100(), PackerConfig(target_batch_time_ms=50.0))
    lengths = [256, 1000, 8192, 65_536, 262_144]
    times = [cache.total_s(n) for n in lengths]
    assert times == sorted(times)
    assert times[-1] / times[-2] > 4.0 * 1.05  # attention makes 4x the tokens cost more than 4x
    # Each chunk of the simulation fits the target, so T(l) is at least l / max-chunk iterations.
    assert cache.total_s(65_536) >= 8 * 0.050 * 0.5


def test_a_long_prefix_over_budget_takes_chunks_worth_their_step():
    """Attention over a 64K-token prefix alone fills the target: minimum chunks would pay it
    every 32 tokens; the packer takes what fits in one more target instead."""
    model = AnalyticModel(ms_per_token=0.005, ms_per_attended_pair=2e-8,
                          iteration_overhead_ms=5.0)
    config = PackerConfig(target_batch_time_ms=50.0)
    budget = PrefillBudget(model, config)
    minimum_ms = budget.estimate.time_with_prefill_ms(65_536, config.min_chunk_tokens)
    assert minimum_ms < 50.0  # 32 tokens fit: the plain budget decides
    size = budget.chunk_for(65_536, 100_000)
    assert 32 < size and budget.estimate.time_with_prefill_ms(65_536, size) <= 50.0
    # A step that costs 80 ms whatever its chunk (a kernel short of parallelism, a fixed
    # cost): the chunk grows until it costs one more target.
    slow = AnalyticModel(ms_per_token=0.005, ms_per_attended_pair=1e-7,
                         iteration_overhead_ms=80.0)
    over = PrefillBudget(slow, config)
    minimum_ms = over.estimate.time_with_prefill_ms(65_536, config.min_chunk_tokens)
    assert minimum_ms > 50.0
    size = over.chunk_for(65_536, 100_000)
    assert size > 4000
    assert over.estimate.time_with_prefill_ms(65_536, size) <= minimum_ms + 50.0 + 1e-6
