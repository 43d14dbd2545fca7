"""Mixture-of-experts models served end to end: ``slipstream serve`` on a small random
Mixtral and Qwen3-MoE (written by transformers' own classes), asked through the official
``openai`` client, answers with transformers' greedy ``generate`` tokens; ``--ep 2`` too, and
the Mixtral written as a GGUF file and served from it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from slipstream.agent.engine.models.tiny_moe import write_tiny_moe
from slipstream.agent.engine.tokenizer import Tokenizer
from tests.engine.gguf_moe_writer import write_moe_gguf

from .conftest import serve

PROMPTS = [[7, 99, 1023, 5, 42, 17], [4000 - 13 * i for i in range(40)]]
NEW_TOKENS = 12


def transformers_greedy(model_dir, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generation = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=generation)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family,flags", [("mixtral", ()), ("qwen3_moe", ()),
                                          ("mixtral", ("--ep", "2")), ("mixtral", ("gguf",))],
                         ids=["mixtral", "qwen3_moe", "mixtral-ep2", "mixtral-gguf"])
def test_served_greedy_output_equals_transformers_generate(tmp_path, family, flags):
    model_dir = write_tiny_moe(tmp_path / family, family)
    expected = [transformers_greedy(model_dir, prompt) for prompt in PROMPTS]
    tokenizer = Tokenizer.from_dir(model_dir)
    served, env = model_dir, None
    if flags == ("gguf",):  # `slipstream serve --model FILE.gguf`, its tensors from the file
        served = write_moe_gguf(model_dir, tmp_path / "mixtral.gguf")
        flags, env = (), {"SLIPSTREAM_CACHE_DIR": str(tmp_path / "cache")}
    with serve(served, tmp_path, *flags, env=env) as server:
        client = server.openai_client()
        for prompt, tokens in zip(PROMPTS, expected):
            completion = client.completions.create(
                model=server.model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                logprobs=1, extra_body={"ignore_eos": True})
            choice = completion.choices[0]
            assert completion.usage.completion_tokens == NEW_TOKENS
            # Token by token: the logprobs name each sampled token by its text.
            assert choice.logprobs.tokens == [tokenizer.token_text(t) for t in tokens]
            assert choice.text == tokenizer.decode(tokens)
    if env is not None:  # the cache holds the file's config and tokenizer, no float copy
        assert list((tmp_path / "cache").rglob("config.json"))
        assert not list((tmp_path / "cache").rglob("*.safetensors"))
