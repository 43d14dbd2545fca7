"""CUDA graphs per (length, batch) short-prefill bucket: capture, replay, and replay against
the eager path (GPU only; skipped without CUDA).

Both runners use float32 weights and the torch attention backend, so the eager side is the
same reference as on CPU and tolerances stay tight. Both turn ``cuda_graphs`` off (on CUDA it
defaults on: decode and piecewise mixed-step graphs), so the eager side is eager and the only
graphs on the other are the short-prefill buckets. The classic CUDA-graph bug is a replay
that reads stale inputs (a copy into a new tensor instead of the captured buffer): the
sequence test replays the same bucket with different prompts back to back.
"""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig, ShortPrefillBuckets
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.step.prefill_buckets import PrefillBucket
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.sampling import SamplingOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK = 16
NUM_BLOCKS = 256
GREEDY = SamplingOptions(temperature=0.0)
BUCKETS = ShortPrefillBuckets(lengths_tokens=(16, 32, 64, 128), batch_sizes=(1, 2, 4, 8),
                              max_padding_factor=1e6)
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # fp32; cuBLAS picks different kernels per shape


def make_runner(model_dir, cuda_graphs: bool) -> ModelRunner:
    config = EngineConfig(model_dir=model_dir, device="cuda", dtype="float32",
                          attention_backend="torch", num_kv_blocks=NUM_BLOCKS, cuda_graphs=False,
                          short_prefill_graphs=cuda_graphs, short_prefill_buckets=BUCKETS)
    return ModelRunner(config, ModelConfig.from_dir(model_dir))


@pytest.fixture(scope="module")
def eager(tiny_model_dir):
    return make_runner(tiny_model_dir, cuda_graphs=False)


@pytest.fixture(scope="module")
def graphed(tiny_model_dir):
    return make_runner(tiny_model_dir, cuda_graphs=True)


def fresh_prompts(rng: random.Random, lengths: list[int]) -> tuple[ScheduledChunk, ...]:
    counts = [-(-(length + 1) // BLOCK) for length in lengths]
    order = rng.sample(range(NUM_BLOCKS), sum(counts))
    chunks, used = [], 0
    for index, (length, count) in enumerate(zip(lengths, counts)):
        tokens = tuple(rng.randrange(4000) for _ in range(length))
        chunks.append(ScheduledChunk(f"r{index}", tokens, 0, tuple(order[used:used + count]),
                                     True, GREEDY))
        used += count
    return tuple(chunks)


def test_one_graph_is_captured_per_bucket(graphed):
    executor = graphed.short_prefill
    assert executor.use_graphs
    assert executor.num_graphs == BUCKETS.num_buckets == 16


def test_replay_equals_eager_for_several_batches(eager, graphed):
    rng = random.Random(0)
    seen = set()
    for lengths in ([1], [16], [17, 5], [64, 3, 40, 9], [100, 128, 2], [33] * 8, [7] * 5):
        chunks = fresh_prompts(rng, lengths)
        bucket = graphed.short_prefill.select(chunks)
        assert bucket is not None
        seen.add(bucket)
        batch = Batch(chunks=chunks)
        runs = graphed.short_prefill.runs_per_bucket[bucket]
        torch.testing.assert_close(graphed.sample_logits(batch), eager.sample_logits(batch),
                                   **TOLERANCE)
        assert graphed.short_prefill.runs_per_bucket[bucket] == runs + 1
        for (eager_k, _), (graph_k, _) in zip(eager.kv_caches, graphed.kv_caches):
            for chunk in chunks:
                blocks = list(chunk.block_ids[:chunk.num_tokens // BLOCK])
                torch.testing.assert_close(graph_k[blocks], eager_k[blocks], **TOLERANCE)
    assert len(seen) >= 5


def test_replay_after_new_inputs_is_not_stale(eager, graphed):
    rng = random.Random(1)
    first = fresh_prompts(rng, [20, 30, 25])
    second = fresh_prompts(rng, [31, 18, 22])
    bucket = graphed.short_prefill.select(first)
    assert bucket == graphed.short_prefill.select(second) == PrefillBucket(32, 4)
    first_logits = graphed.sample_logits(Batch(chunks=first))
    second_logits = graphed.sample_logits(Batch(chunks=second))
    assert not torch.allclose(first_logits, second_logits)
    torch.testing.assert_close(second_logits, eager.sample_logits(Batch(chunks=second)),
                               **TOLERANCE)
    # And back: the first batch again gives the first answer.
    torch.testing.assert_close(graphed.sample_logits(Batch(chunks=first)), first_logits,
                               **TOLERANCE)


def test_greedy_decode_after_a_graphed_prefill_matches_eager(eager, graphed):
    rng = random.Random(2)
    chunks = fresh_prompts(rng, [40, 12, 60])
    batch = Batch(chunks=chunks)
    assert graphed.execute(batch) == eager.execute(batch)
    tokens = eager.sample_logits(batch).argmax(dim=-1).tolist()
    decode = Batch(chunks=tuple(
        ScheduledChunk(c.request_id, (token,), c.num_tokens, c.block_ids, True, GREEDY, 1)
        for c, token in zip(chunks, tokens)))
    assert graphed.execute(decode) == eager.execute(decode)


def test_engine_output_is_the_same_with_graphs_on_and_off(tiny_model_dir):
    prompts = [[(31 * i + 7 * j) % 4000 for j in range(length)]
               for i, length in enumerate([3, 40, 61, 18, 12, 7])]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for cuda_graphs in (False, True):
        engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cuda",
                                        dtype="float32", attention_backend="torch",
                                        num_kv_blocks=NUM_BLOCKS, cuda_graphs=False,
                                        short_prefill_graphs=cuda_graphs,
                                        scheduler=SchedulerConfig(max_batched_tokens=4096)))
        outputs.append(engine.generate(prompts, params))
        if cuda_graphs:  # 141 tokens in 6 prompts: bucket (64, 8), under the padding cap
            assert engine.runner.short_prefill.num_graphs == ShortPrefillBuckets().num_buckets
            assert sum(engine.runner.short_prefill.runs_per_bucket.values()) >= 1
        engine.close()
    assert outputs[0] == outputs[1]
