"""Chunked prefill with any split gives the same logits and tokens as one-shot prefill."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.scheduler import SchedulerConfig

BLOCK = 16


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    config = EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=32)
    return ModelRunner(config, ModelConfig.from_dir(tiny_model_dir))


def prefill_then_decode(runner, prompt, cuts, blocks, steps=6):
    """Prefill `prompt` in chunks ending at `cuts`, then greedy-decode `steps` tokens."""
    last_logits, start = None, 0
    for end in list(cuts) + [len(prompt)]:
        if end <= start:
            continue
        chunk = ScheduledChunk("r", tuple(prompt[start:end]), start, blocks, end == len(prompt))
        last_logits = runner.compute_logits(Batch(chunks=(chunk,)))[-1]
        start = end
    tokens = [int(torch.argmax(last_logits))]
    for _ in range(steps - 1):
        position = len(prompt) + len(tokens) - 1
        chunk = ScheduledChunk("r", (tokens[-1],), position, blocks, True)
        tokens.append(int(torch.argmax(runner.compute_logits(Batch(chunks=(chunk,)))[-1])))
    return last_logits, tokens


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_chunk_splits_equal_unchunked(runner, data):
    length = data.draw(st.integers(2, 120), label="prompt length")
    prompt = data.draw(st.lists(st.integers(0, 4000), min_size=length, max_size=length))
    cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=8), label="cuts"))
    blocks = tuple(data.draw(st.permutations(range(32)))[: -(-(length + 8) // BLOCK)])
    whole_logits, whole_tokens = prefill_then_decode(runner, prompt, [], blocks)
    chunked_logits, chunked_tokens = prefill_then_decode(runner, prompt, cuts, blocks)
    torch.testing.assert_close(chunked_logits, whole_logits, atol=1e-5, rtol=1e-5)
    assert chunked_tokens == whole_tokens


def test_engine_budget_does_not_change_outputs(tiny_model_dir):
    """Concurrent requests under a 7-token budget (many chunks, mixed with decodes) produce the
    same greedy tokens as under a budget that prefills everything at once."""
    prompts = [[(31 * i + 7 * j) % 4000 for j in range(length)]
               for i, length in enumerate([3, 40, 75, 18, 130])]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = []
    for budget in (7, 4096):
        engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=64),
                           SchedulerConfig(max_batched_tokens=budget))
        outputs.append(engine.generate(prompts, params))
        assert engine.block_manager.kv_blocks_used == 0
    assert outputs[0] == outputs[1]
