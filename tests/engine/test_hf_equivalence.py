"""The engine's Llama against Hugging Face transformers on the same model directory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk

PROMPTS = [
    [7, 99, 1023, 5, 42],
    list(range(300, 337)),
    [4000 - 13 * i for i in range(70)],
    [1],
]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    config = EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=64)
    return ModelRunner(config, ModelConfig.from_dir(tiny_model_dir))


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
def test_prefill_logits_match_transformers(runner, hf_model, prompt):
    blocks = tuple(range(63, 63 - (len(prompt) + 15) // 16, -1))  # non-contiguous, descending
    ours = runner.compute_logits(Batch(chunks=(ScheduledChunk("r", tuple(prompt), 0, blocks, True),)))
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)


def test_greedy_tokens_match_transformers(tiny_model_dir, hf_model):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=128))
    new_tokens = 24
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ours = engine.generate(PROMPTS, params)  # all prompts batched together
    generation = GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=0)
    for prompt, tokens in zip(PROMPTS, ours):
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([prompt]), generation_config=generation)
        assert tokens == reference[0, len(prompt):].tolist()
    assert engine.block_manager.kv_blocks_used == 0
