"""Qwen3, Gemma 2 and Gemma 3 (tests/engine/family_models.py) against transformers on the same
directory, and the engine's own invariants on them: chunking, prefix caching and preemption
change no greedy token. Gemma's sliding window (12 tokens) is shorter than most prompts here,
so every check also covers attention past the window, in decodes and in prefill chunks."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.scheduler import SchedulerConfig
from tests.engine.family_models import FAMILIES, SLIDING_WINDOW, load_reference

PROMPTS = [
    [7, 99, 1023, 5, 42],
    [(31 * j + 11) % 4000 for j in range(45)],
    [4000 - 13 * i for i in range(70)],
    [1],
]
NEW_TOKENS = 12
# The Triton kernels run compiled on a CUDA machine (which does not set TRITON_INTERPRET, so
# they cannot run on a CPU there), else under the interpreter; float32 either way.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def reference_tokens(model_dir, prompts, max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    model = load_reference(model_dir)
    generation = GenerationConfig(do_sample=False, max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, pad_token_id=0)
    tokens = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), generation_config=generation)
        tokens.append(out[0, len(prompt):].tolist())
    return tokens


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, family_model_dirs):
    return request.param, family_model_dirs[request.param]


def test_config_reads_the_family_options(family_model_dirs):
    qwen3 = ModelConfig.from_dir(family_model_dirs["qwen3"])
    assert qwen3.qk_norm and qwen3.norm_weight_offset == 0 and qwen3.sliding_window is None
    gemma2 = ModelConfig.from_dir(family_model_dirs["gemma2"])
    assert [gemma2.sliding_window_of(i) for i in range(4)] == [SLIDING_WINDOW, None] * 2
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert not gemma2.qk_norm and gemma2.attention_scale == 24 ** -0.5
    gemma3 = ModelConfig.from_dir(family_model_dirs["gemma3_text"])
    assert [gemma3.uses_local_rope(i) for i in range(4)] == [True, True, True, False]
    assert gemma3.rope_local_theta == 1_000.0 and gemma3.rope_theta == 100_000.0
    assert gemma3.rope_scaling.rope_type == "linear" and gemma3.qk_norm


def test_an_unsupported_model_type_is_one_line_naming_it():
    raw = {"model_type": "mamba", "architectures": ["MambaForCausalLM"]}
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dict(raw)
    message = str(error.value)
    assert "\n" not in message and "'mamba'" in message
    assert all(name in message for name in ("gemma2", "gemma3_text", "llama", "qwen3"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_logits_match_transformers(family, backend):
    name, model_dir = family
    prompt = PROMPTS[1] if backend == "torch" else PROMPTS[1][:24]  # the interpreter is slow
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device=device, dtype="float32",
                                      num_kv_blocks=16, attention_backend=backend),
                         ModelConfig.from_dir(model_dir))
    blocks = tuple(range(15, 15 - (len(prompt) + 15) // 16, -1))  # non-contiguous, descending
    ours = runner.compute_logits(Batch(chunks=(ScheduledChunk("r", tuple(prompt), 0, blocks,
                                                              True),)))
    with torch.no_grad():
        reference = load_reference(model_dir)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours.cpu(), reference, atol=5e-5, rtol=1e-4)


def test_greedy_tokens_match_transformers_generate(family):
    name, model_dir = family
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64))
    ours = engine.generate(PROMPTS, greedy())  # batched: decodes beside each other
    assert ours == reference_tokens(model_dir, PROMPTS)
    assert engine.block_manager.kv_blocks_used == 0


def test_mistral_sliding_window_past_the_window_matches_transformers(tmp_path, tiny_model_dir):
    """Mistral's window covers every layer; prompts and decodes run past it (the context
    is no longer capped at the window)."""
    from tests.engine.family_models import write_family_model

    model_dir = write_family_model("mistral", tiny_model_dir, tmp_path / "mistral")
    assert ModelConfig.from_dir(model_dir).sliding_window_of(3) == SLIDING_WINDOW
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64),
                       SchedulerConfig(max_batched_tokens=16))
    assert engine.generate(PROMPTS, greedy()) == reference_tokens(model_dir, PROMPTS)


def test_triton_decodes_past_the_window_match_transformers(family_model_dirs):
    """Gemma 2 (soft-capped scores) and Gemma 3 on the Triton kernels, under the interpreter
    (compiled, eager, on a CUDA machine): prompts of 5 and 14 tokens decode to 20, past the
    12-token window."""
    for name in ("gemma2", "gemma3_text"):
        model_dir = family_model_dirs[name]
        prompts = [PROMPTS[0], PROMPTS[1][:14]]
        engine = LLMEngine(EngineConfig(model_dir=model_dir, device=TRITON_DEVICE,
                                        dtype="float32", num_kv_blocks=16,
                                        attention_backend="triton", cuda_graphs=False))
        assert engine.generate(prompts, greedy(6)) == reference_tokens(model_dir, prompts, 6)


def test_chunked_prefill_equals_unchunked(family):
    name, model_dir = family
    outputs = []
    for budget in (512, 7):  # 7 tokens a step: chunks that cut the window at every offset
        engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64),
                           SchedulerConfig(max_batched_tokens=budget))
        outputs.append(engine.generate(PROMPTS[1:3], greedy(6)))
    assert outputs[0] == outputs[1]


def test_prefix_caching_keeps_greedy_output(family):
    name, model_dir = family
    document = PROMPTS[2]
    rounds = [[document + [5, 6, 7]], [document + [9], document[:40] + [11, 12]]]
    results, hits = [], []
    for caching in (False, True):
        engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=128),
                           SchedulerConfig(max_batched_tokens=32, prefix_caching=caching))
        results.append([engine.generate(prompts, greedy(16)) for prompts in rounds])
        hits.append(engine.stats().prefix_cache_hit_tokens)
        assert engine.stats().kv_blocks_used == 0
    assert results[0] == results[1]
    assert hits[0] == 0 and hits[1] >= 64  # the second round reused the document's blocks


def test_preemption_keeps_greedy_output(family):
    name, model_dir = family
    prompts = [[(17 * i + 3 * j) % 4000 for j in range(30 + 9 * i)] for i in range(5)]
    results, preemptions = [], []
    for num_blocks in (10, 128):  # 10 blocks = 160 tokens; one request needs up to 6
        engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu",
                                        num_kv_blocks=num_blocks),
                           SchedulerConfig(max_batched_tokens=48))
        results.append(engine.generate(prompts, greedy(24)))
        preemptions.append(engine.stats().num_preemptions_total)
        assert engine.stats().kv_blocks_used == 0
    assert preemptions[0] > 0 and preemptions[1] == 0
    assert results[0] == results[1]
