"""The padded (length, batch) bucket path for fresh short prefills, run eagerly on CPU.

This is the same code a CUDA graph captures (see test_cuda_graphs_gpu.py); here it is checked
against the normal eager path: logits at each prompt's last token, the KV it writes, a decode
that follows, blocks it must not touch, and whole engine runs.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.agent.engine.config import EngineConfig, ModelConfig, ShortPrefillBuckets
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.step.prefill_buckets import PrefillBucket
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.sampling import SamplingOptions
from slipstream.agent.scheduler.scheduler import SchedulerConfig

BLOCK = 16
NUM_BLOCKS = 96
CANARY = 123.0
GREEDY = SamplingOptions(temperature=0.0)
# Small buckets keep CPU time low; a cap high enough that every fitting batch is padded.
BUCKETS = ShortPrefillBuckets(lengths_tokens=(16, 32, 64), batch_sizes=(1, 2, 4, 8),
                              max_padding_factor=1e6)


def make_runner(model_dir, cuda_graphs: bool, buckets=BUCKETS) -> ModelRunner:
    config = EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=NUM_BLOCKS,
                          short_prefill_graphs=cuda_graphs, short_prefill_buckets=buckets)
    return ModelRunner(config, ModelConfig.from_dir(model_dir))


@pytest.fixture(scope="module")
def eager(tiny_model_dir):
    return make_runner(tiny_model_dir, cuda_graphs=False)


@pytest.fixture(scope="module")
def bucketed(tiny_model_dir):
    return make_runner(tiny_model_dir, cuda_graphs=True)


def fresh_prompts(rng: random.Random, lengths: list[int]) -> tuple[ScheduledChunk, ...]:
    """Whole prompts with room for one decode token each, in shuffled blocks."""
    counts = [-(-(length + 1) // BLOCK) for length in lengths]
    order = rng.sample(range(NUM_BLOCKS), sum(counts))
    chunks, used = [], 0
    for index, (length, count) in enumerate(zip(lengths, counts)):
        tokens = tuple(rng.randrange(4000) for _ in range(length))
        chunks.append(ScheduledChunk(f"r{index}", tokens, 0, tuple(order[used:used + count]),
                                     True, GREEDY))
        used += count
    return tuple(chunks)


def decodes_after(chunks, logits: torch.Tensor) -> Batch:
    tokens = logits.argmax(dim=-1).tolist()
    return Batch(chunks=tuple(
        ScheduledChunk(c.request_id, (token,), c.num_tokens, c.block_ids, True, GREEDY, 1)
        for c, token in zip(chunks, tokens)))


def fill_free_blocks(runner: ModelRunner, used: set[int]) -> list[int]:
    free = [block for block in range(NUM_BLOCKS) if block not in used]
    for k_cache, v_cache in runner.kv_caches:
        k_cache[free] = CANARY
        v_cache[free] = CANARY
    return free


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_padded_path_equals_eager_in_logits_kv_and_the_next_decode(eager, bucketed, lengths,
                                                                    seed):
    chunks = fresh_prompts(random.Random(seed), lengths)
    batch = Batch(chunks=chunks)
    assert bucketed.short_prefill.select(chunks) is not None
    used = {block for chunk in chunks for block in chunk.block_ids}
    free = fill_free_blocks(bucketed, used)
    runs_before = sum(bucketed.short_prefill.runs_per_bucket.values())

    expected, got = eager.sample_logits(batch), bucketed.sample_logits(batch)

    assert sum(bucketed.short_prefill.runs_per_bucket.values()) == runs_before + 1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for (eager_k, eager_v), (padded_k, padded_v) in zip(eager.kv_caches, bucketed.kv_caches):
        for chunk in chunks:
            slots = [chunk.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK
                     for pos in range(chunk.num_tokens)]
            for eager_cache, padded_cache in ((eager_k, padded_k), (eager_v, padded_v)):
                torch.testing.assert_close(padded_cache.flatten(0, 1)[slots],
                                           eager_cache.flatten(0, 1)[slots],
                                           atol=1e-5, rtol=1e-5)
        # Padding went to the scratch block, never to a block the manager could hand out.
        assert bool((padded_k[free] == CANARY).all()) and bool((padded_v[free] == CANARY).all())
    # The decode that follows (eager on both: it is not a fresh prefill) reads that KV.
    decode = decodes_after(chunks, expected)
    assert bucketed.short_prefill.select(decode.chunks) is None
    torch.testing.assert_close(bucketed.sample_logits(decode), eager.sample_logits(decode),
                               atol=1e-5, rtol=1e-5)
    assert bucketed.execute(decode) == eager.execute(decode)


def test_the_scratch_block_lies_past_the_managed_blocks(bucketed, eager):
    assert bucketed.num_kv_blocks == eager.num_kv_blocks == NUM_BLOCKS
    assert bucketed.kv_caches[0][0].shape[0] == NUM_BLOCKS + 1
    assert eager.kv_caches[0][0].shape[0] == NUM_BLOCKS


def test_execute_picks_the_smallest_bucket_and_falls_back_when_none_fits(bucketed):
    rng = random.Random(7)
    runs = bucketed.short_prefill.runs_per_bucket
    before = runs.copy()
    bucketed.execute(Batch(chunks=fresh_prompts(rng, [20, 3, 9])))
    assert runs - before == {PrefillBucket(32, 4): 1}
    for lengths in ([65], [4] * 9):  # longer than 64 tokens; more than 8 prompts
        before = runs.copy()
        sampled = bucketed.execute(Batch(chunks=fresh_prompts(rng, lengths)))
        assert len(sampled) == len(lengths) and runs == before


def test_padding_cap_keeps_mostly_padding_batches_eager(tiny_model_dir):
    capped = make_runner(tiny_model_dir, cuda_graphs=True, buckets=ShortPrefillBuckets(
        lengths_tokens=(16, 64), batch_sizes=(1, 4), max_padding_factor=4.0))
    rng = random.Random(3)
    assert capped.short_prefill.select(fresh_prompts(rng, [60, 1, 1])) is None  # 256 for 62
    assert capped.short_prefill.select(fresh_prompts(rng, [60, 40])) == PrefillBucket(64, 4)


@pytest.mark.parametrize(("lengths", "budget"), [
    ([3, 40, 61, 18, 12, 7], 4096),  # every prompt in one bucketed step
    ([3, 40, 75, 18, 130, 9], 48),  # chunked prefills, decodes mixed in: mostly eager
])
def test_engine_output_is_the_same_with_the_option_on_and_off(tiny_model_dir, lengths, budget):
    prompts = [[(31 * i + 7 * j) % 4000 for j in range(length)]
               for i, length in enumerate(lengths)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for cuda_graphs in (False, True):
        engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu",
                                        num_kv_blocks=64, short_prefill_graphs=cuda_graphs),
                           SchedulerConfig(max_batched_tokens=budget))
        outputs.append(engine.generate(prompts, params))
        if cuda_graphs and budget >= sum(lengths):
            assert sum(engine.runner.short_prefill.runs_per_bucket.values()) >= 1
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_the_cuda_graph_benchmark_refuses_to_run_without_a_gpu(tmp_path, capsys):
    from slipstream.bench.cuda_graph_bench import EXIT_NO_GPU, main

    assert main(["--out", str(tmp_path / "out")]) == EXIT_NO_GPU
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
