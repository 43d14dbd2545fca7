"""GGUF files of the mixture-of-experts architectures (Mixtral as ``llama`` with experts,
``qwen2moe`` with a shared expert and a dense layer, ``qwen3moe``, ``olmoe``), written from small
random transformers models as llama.cpp's converter writes them, load with their MoE settings
and give transformers' prefill logits and greedy tokens on the original directory; expert
tensors stored quantized are dequantized at load, with a warning that names the cost, to
exactly the gguf library's values."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.models.gguf_model import GGUFError, convert
from slipstream.agent.engine.models.gguf_weights import read_gguf_weights
from slipstream.agent.engine.models.tiny_moe import FAMILIES
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.sampling import SamplingParams
from tests.engine.gguf_moe_writer import write_dequantized_reference, write_moe_gguf

PROMPTS = [[7, 99, 1023, 5, 42], list(range(300, 337)), [4000 - 13 * i for i in range(70)]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
QUANTIZED_EXPERTS = {"gate": "Q8_0", "up": "Q8_0", "down": "Q4_0"}


def assert_serves_like_transformers(model_dir, gguf_file, reference_dir) -> None:
    """Prefill logits and greedy tokens of ``model_dir`` (its weights from ``gguf_file`` when
    given) equal transformers' on ``reference_dir`` in float32."""
    config = EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64,
                          gguf_file=gguf_file)
    runner = ModelRunner(config, ModelConfig.from_dir(model_dir))
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    for ours, expected in _prefill_logits(runner, reference):
        torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
    del runner
    generation = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, pad_token_id=0)
    expected_tokens = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), generation_config=generation)
        expected_tokens.append(out[0, len(prompt):].tolist())
    assert LLMEngine(config).generate(PROMPTS, GREEDY) == expected_tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("served", ["converted", "from-the-file"])
def test_gguf_round_trip_serves_transformers_logits_and_tokens(family, served, moe_model_dirs,
                                                               tmp_path):
    source = moe_model_dirs[family]
    gguf_file = write_moe_gguf(source, tmp_path / f"{family}.gguf")
    converted = convert(gguf_file, tmp_path / "hf", weights=served == "converted")
    ours, original = ModelConfig.from_dir(converted), ModelConfig.from_dir(source)
    assert ours.moe is not None and ours.moe == original.moe  # experts, top-k, widths, layers
    for field in ("model_type", "attention_bias", "qk_norm", "rope_theta", "rms_norm_eps",
                  "tie_word_embeddings", "sliding_window", "head_dim", "intermediate_size"):
        assert getattr(ours, field) == getattr(original, field), field
    assert json.loads((converted / "config.json").read_text())["architectures"] == \
        json.loads((source / "config.json").read_text())["architectures"]
    assert_serves_like_transformers(converted, None if served == "converted" else gguf_file,
                                    source)


def test_older_mixtral_files_with_one_tensor_per_expert(moe_model_dirs, tmp_path):
    source = moe_model_dirs["mixtral"]
    gguf_file = write_moe_gguf(source, tmp_path / "mixtral.gguf", per_expert=True)
    converted = convert(gguf_file, tmp_path / "hf", weights=False)
    assert ModelConfig.from_dir(converted).moe == ModelConfig.from_dir(source).moe
    assert_serves_like_transformers(converted, gguf_file, source)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantized_experts_dequantize_to_the_gguf_values_with_a_warning(family, moe_model_dirs,
                                                                        tmp_path, caplog):
    source = moe_model_dirs[family]
    gguf_file = write_moe_gguf(source, tmp_path / f"{family}.gguf", QUANTIZED_EXPERTS)
    reference_dir = write_dequantized_reference(source, tmp_path / "reference",
                                                QUANTIZED_EXPERTS)
    converted = convert(gguf_file, tmp_path / "hf", weights=False)
    raw = json.loads((converted / "config.json").read_text())
    with caplog.at_level(logging.WARNING):
        weights = dict(read_gguf_weights(gguf_file, raw))
    # Every expert stack the same floats the gguf library's dequantizer gives (gate, up fused).
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    reference_state = reference.state_dict()
    sparse = ModelConfig.from_dir(converted).moe.sparse_layers(raw["num_hidden_layers"])
    for layer in sparse:
        for part in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{part}"
            assert torch.equal(weights[name], reference_state[name]), name
    del reference, reference_state, weights
    warnings = [r.getMessage() for r in caplog.records if "mixture-of-experts" in r.getMessage()]
    assert len(warnings) == 1, warnings
    layers = len(sparse)
    assert f"{layers} Q4_0 + {2 * layers} Q8_0 mixture-of-experts tensors" in warnings[0]
    assert "dequantized to float32" in warnings[0] and "MB in the file" in warnings[0]
    assert_serves_like_transformers(converted, gguf_file, reference_dir)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantized_projections_stay_quantized_beside_float_experts(family, moe_model_dirs,
                                                                   tmp_path):
    """A GGUF as llama.cpp's quantizer leaves it: attention, shared and dense MLPs and the LM
    head in Q8_0 run on Slipstream's quantized kernels (bf16 activations: close to the
    dequantized model, not equal), the experts dequantized."""
    from slipstream.agent.engine.models.quant_kernels import kernel_of

    source = moe_model_dirs[family]
    gguf_file = write_moe_gguf(source, tmp_path / f"{family}.gguf", QUANTIZED_EXPERTS,
                               projection_type="Q8_0")
    reference_dir = write_dequantized_reference(source, tmp_path / "reference",
                                                QUANTIZED_EXPERTS, projection_type="Q8_0")
    converted = convert(gguf_file, tmp_path / "hf", weights=False)
    config = EngineConfig(model_dir=converted, device="cpu", num_kv_blocks=64,
                          gguf_file=gguf_file)
    runner = ModelRunner(config, ModelConfig.from_dir(converted))
    layers = runner.model.model.layers
    assert all("int8-g32" in (kernel_of(layer.self_attn.qkv_fused) or "")
               for layer in layers.values())
    assert "int8-g32" in (kernel_of(runner.model.lm_head) or "")
    if family == "qwen2_moe":  # the dense layer's MLP and the shared experts' projections
        assert "int8-g32" in (kernel_of(layers["1"].mlp.gate_up_fused) or "")
        assert "int8-g32" in (kernel_of(layers["0"].mlp.shared_expert.down_proj) or "")
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    for ours, expected in _prefill_logits(runner, reference):
        p, q = expected.log_softmax(-1), ours.log_softmax(-1)
        kl = (p.exp() * (p - q)).sum(-1)
        assert float(kl.mean()) < 1e-3, kl  # measured: 1e-5 to 3e-5
        assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_widths_missing_from_the_metadata_come_from_the_tensors(moe_model_dirs, tmp_path):
    source = moe_model_dirs["qwen2_moe"]
    gguf_file = write_moe_gguf(source, tmp_path / "qwen2_moe.gguf", widths_in_metadata=False)
    converted = convert(gguf_file, tmp_path / "hf", weights=False)
    ours, original = ModelConfig.from_dir(converted).moe, ModelConfig.from_dir(source).moe
    assert ours == original and ours is not None and ours.shared_expert_intermediate_size > 0


def test_a_router_other_than_softmax_is_refused_in_one_line(moe_model_dirs, tmp_path):
    import gguf

    gguf_file = write_moe_gguf(
        moe_model_dirs["qwen3_moe"], tmp_path / "qwen3_moe.gguf",
        extra_metadata=lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID))
    with pytest.raises(GGUFError, match=r"gating function 2 \(not softmax\) is not supported"):
        convert(gguf_file, tmp_path / "hf", weights=False)


def test_expert_parallel_serves_the_converted_file_not_its_blocks(moe_model_dirs, tmp_path):
    """``--ep 2`` runs a GGUF dequantized (``--quantization none``: the converted directory)
    with exactly one process's tokens; on the file's blocks it is refused in one line."""
    from slipstream.agent.engine.parallel_config import ParallelConfig
    from slipstream.agent.parallel.compose import build_engine

    gguf_file = write_moe_gguf(moe_model_dirs["mixtral"], tmp_path / "mixtral.gguf")
    with pytest.raises(ValueError, match=r"--ep 2: quantized weights .* --quantization none"):
        EngineConfig(model_dir=tmp_path, gguf_file=gguf_file, parallel=ParallelConfig(ep=2))
    converted = convert(gguf_file, tmp_path / "hf")
    outputs = []
    for parallel in (ParallelConfig(), ParallelConfig(ep=2)):
        engine = build_engine(EngineConfig(model_dir=converted, device="cpu", num_kv_blocks=64,
                                           parallel=parallel))
        try:
            outputs.append(engine.generate(PROMPTS, GREEDY))
        finally:
            engine.close()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("parallel", [{"spp": 2}, {"kvp": 2}])
def test_worker_parallelism_refuses_a_gguf_s_blocks_in_one_line(moe_model_dirs, tmp_path,
                                                                parallel):
    """``--spp``/``--kvp`` workers read safetensors, so a GGUF served as its own blocks is
    refused at start-up with the way out, not deep in the workers' loader."""
    from slipstream.agent.engine.parallel_config import ParallelConfig

    gguf_file = write_moe_gguf(moe_model_dirs["mixtral"], tmp_path / "mixtral.gguf")
    with pytest.raises(ValueError, match=r"single process .* --quantization none"):
        EngineConfig(model_dir=tmp_path, gguf_file=gguf_file,
                     parallel=ParallelConfig(**parallel))
    EngineConfig(model_dir=tmp_path, gguf_file=gguf_file, quantization="none",
                 parallel=ParallelConfig(**parallel))


def _prefill_logits(runner, reference):
    """(Slipstream's, transformers') prefill logits of each of PROMPTS."""
    for prompt in PROMPTS:
        blocks = tuple(range(63, 63 - (len(prompt) + 15) // 16, -1))
        ours = runner.compute_logits(
            Batch(chunks=(ScheduledChunk("r", tuple(prompt), 0, blocks, True),)))
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        yield ours, expected
