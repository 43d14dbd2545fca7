"""Mixture-of-experts families (Mixtral, Qwen2-MoE with a shared expert and a dense layer,
Qwen3-MoE with QK-norm, OLMoE with full-width QK-norm and clipping) against transformers on
the same directories; chunked prefill, prefix caching and preemption keep outputs equal."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.models.moe import SparseMoeBlock
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.models.tiny_moe import FAMILIES
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.scheduler import SchedulerConfig

PROMPTS = [[7, 99, 1023, 5, 42], list(range(300, 337)), [4000 - 13 * i for i in range(70)], [1]]
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int]) -> list[int]:
    generation = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=generation)
    return out[0, len(prompt):].tolist()


def engine(model_dir, budget: int = 512, num_blocks: int = 128, **scheduler) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=num_blocks),
                     SchedulerConfig(max_batched_tokens=budget, **scheduler))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(moe_model_dirs, family):
    model_dir = moe_model_dirs[family]
    config = ModelConfig.from_dir(model_dir)
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64),
                         config)
    sparse = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert config.moe is not None and len(sparse) == len(config.moe.sparse_layers(
        config.num_layers)) > 0
    reference_model = hf_model(model_dir)
    for prompt in PROMPTS:
        blocks = tuple(range(63, 63 - (len(prompt) + 15) // 16, -1))
        ours = runner.compute_logits(
            Batch(chunks=(ScheduledChunk("r", tuple(prompt), 0, blocks, True),)))
        with torch.no_grad():
            reference = reference_model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(moe_model_dirs, family):
    model_dir = moe_model_dirs[family]
    ours = engine(model_dir).generate(PROMPTS, GREEDY)  # all prompts batched together
    reference_model = hf_model(model_dir)
    assert ours == [hf_greedy(reference_model, prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_chunked_prefill_equals_unchunked(moe_model_dirs, family):
    model_dir = moe_model_dirs[family]
    whole = engine(model_dir, budget=512).generate(PROMPTS, GREEDY)
    chunked = engine(model_dir, budget=7).generate(PROMPTS, GREEDY)  # chunks mixed with decodes
    assert chunked == whole


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_prefix_caching_and_preemption_keep_outputs(moe_model_dirs, family):
    model_dir = moe_model_dirs[family]
    document = [(37 * j + 11) % 4000 for j in range(90)]
    prompts = [document + [5 + i, 900 + i] for i in range(4)]
    reference = engine(model_dir, budget=64, prefix_caching=False).generate(prompts, GREEDY)
    cached = engine(model_dir, budget=64, prefix_caching=True)
    assert cached.generate(prompts[:1], GREEDY) == reference[:1]
    assert cached.generate(prompts[1:], GREEDY) == reference[1:]
    assert cached.stats().prefix_cache_hit_tokens > 0
    small = engine(model_dir, budget=64, num_blocks=12, preemption="recompute")
    assert small.generate(prompts, GREEDY) == reference
    assert small.stats().num_preemptions_total > 0
