"""Weight formats behind the linear layer (``models/weight_formats.py``, ``quant_kernels.py``,
``quantization.py``): quantizers within their step, each CPU kernel against the float32
reference of the same quantized weight, a model quantized at load against its float self,
memory not doubled, and the start-up errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.models.loader import WeightSource, load_model
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.models.quant_kernels import (
    Int4PackedCPU, Int8PackedMM, QuantEmbedding, QuantLinear, WeightFormatError, kernel_of,
    weight_bytes)
from slipstream.agent.engine.models.weight_formats import (
    Int4Weight, concat_rows, quantize, quantize_fp8, quantize_int4, quantize_int8,
    reference_linear)
from slipstream.agent.engine.models.quantization import QuantizationError, resolve_quantization
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.models.tiny_model import PRESETS, write_tiny_model
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk

CPU = torch.device("cpu")


def weights(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed))


def test_quantizers_stay_within_half_a_step():
    weight = weights(48, 128)
    int8 = quantize_int8(weight)
    assert int8.values.dtype == torch.int8
    assert ((int8.dequantize(torch.float32) - weight).abs()
            <= int8.scale[:, None] / 2 + 1e-6).all()
    for group in (32, 64, 128):
        int4 = quantize_int4(weight, group)
        assert int4.packed.shape == (48, 64) and int4.scale.shape == (48, 128 // group)
        error = (int4.dequantize(torch.float32) - weight).abs().view(48, -1, group)
        assert (error <= int4.scale[..., None] / 2 + 1e-5).all()
    fp8 = quantize_fp8(weight)
    relative = (fp8.dequantize(torch.float32) - weight).abs() / weight.abs().clamp(min=1e-3)
    assert relative.median() < 0.07  # e4m3 keeps 3 mantissa bits
    assert quantize_fp8(weight, per_channel=False).scale.shape == (1,)


def test_int4_nibbles_round_trip_and_rows_concatenate():
    weight = weights(40, 64, seed=1)
    a, b = quantize_int4(weight[:24], 32), quantize_int4(weight[24:], 32)
    whole = concat_rows([a, b])
    assert isinstance(whole, Int4Weight)
    torch.testing.assert_close(whole.dequantize(torch.float32),
                               torch.cat([a.dequantize(torch.float32),
                                          b.dequantize(torch.float32)]))
    assert concat_rows([a, quantize_int4(weight[24:], 64)]) is None  # layouts differ
    assert concat_rows([a, quantize_int8(weight[24:])]) is None  # formats differ
    index = torch.tensor([3, 0, 39])
    torch.testing.assert_close(whole.rows(index, torch.float32),
                               whole.dequantize(torch.float32)[index])


@pytest.mark.parametrize("rows", [1, 3, 32, 100])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_cpu_kernel_matches_the_reference(rows, group):
    weight = quantize_int4(weights(192, 256, seed=group), group)
    hidden = weights(rows, 256, seed=rows)
    ours = Int4PackedCPU(weight)(hidden)
    reference = reference_linear(hidden, weight)
    # bf16 activations and output: about 3 significant digits.
    torch.testing.assert_close(ours, reference, rtol=2e-2, atol=2e-2 * reference.abs().max())
    assert ours.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_cpu_kernel_matches_the_reference(rows):
    weight = quantize_int8(weights(96, 160, seed=rows))
    hidden = weights(rows, 160, seed=7)
    reference = reference_linear(hidden, weight)
    torch.testing.assert_close(Int8PackedMM(weight, torch.bfloat16)(hidden), reference,
                               rtol=2e-2, atol=2e-2 * reference.abs().max())


def test_quant_linear_keeps_leading_dimensions_and_adds_the_bias():
    weight = quantize_int8(weights(24, 64))
    bias = torch.randn(24)
    layer = QuantLinear(weight, bias)
    layer.prepare(CPU)
    hidden = weights(6, 64, seed=3)
    out = layer(hidden.view(2, 3, 64))
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.view(6, 24), reference_linear(hidden, weight, bias),
                               rtol=2e-2, atol=5e-2)
    assert "int8" in (kernel_of(layer) or "")


def test_fp8_has_no_cpu_kernel_and_says_what_to_do():
    layer = QuantLinear(quantize_fp8(weights(32, 64)))
    with pytest.raises(WeightFormatError, match=r"fp8-channel weights have no CPU kernel.*"
                                                r"--quantization int8"):
        layer.prepare(CPU)


def test_embedding_rows_come_from_the_quantized_matrix():
    weight = quantize(weights(50, 64), "int8")
    embedding = QuantEmbedding(weight, torch.float32)
    ids = torch.tensor([4, 4, 49, 0])
    torch.testing.assert_close(embedding(ids), weight.dequantize(torch.float32)[ids])
    head = embedding.tied_lm_head()
    head.prepare(CPU)
    kernel = head.kernel
    assert isinstance(kernel, Int8PackedMM)
    assert kernel.values.data_ptr() == weight.values.data_ptr()  # one matrix, not two


def logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    blocks = tuple(range((len(prompt) + 15) // 16))
    return runner.compute_logits(Batch(chunks=(ScheduledChunk("r", tuple(prompt), 0, blocks,
                                                              True),)))


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p, q = reference.log_softmax(-1), other.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


PROMPT = [7, 99, 1023, 5, 42, 300, 301, 302, 17, 18, 19, 2000, 3, 4, 5, 6, 900, 901, 44]


@pytest.fixture(scope="module")
def tiny192_dir(tmp_path_factory) -> Path:
    """The tiny model with an MLP 192 wide (the tiny preset's 172 fits no int4 group)."""
    path = tmp_path_factory.mktemp("models") / "tiny192"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PRESETS, "tiny192", replace(PRESETS["tiny"], intermediate_size=192))
        write_tiny_model(path, "tiny192", seed=0)
    return path


def float_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=8),
                       ModelConfig.from_dir(model_dir))


@pytest.mark.parametrize("quantization,max_kl", [("int8", 1e-3), ("int4", 0.1)])
def test_a_model_quantized_at_load_stays_near_its_float_self(tiny192_dir, quantization,
                                                             max_kl):
    float_logits = logits(float_runner(tiny192_dir), PROMPT)
    config = EngineConfig(model_dir=tiny192_dir, device="cpu", num_kv_blocks=8,
                          quantization=quantization, quantization_group_size=32)
    runner = ModelRunner(config, ModelConfig.from_dir(tiny192_dir))
    layer = runner.model.model.layers["0"]
    assert quantization in (kernel_of(layer.self_attn.qkv_fused) or "")
    assert quantization in (kernel_of(layer.mlp.gate_up_fused) or "")
    assert layer.self_attn.q_proj is None  # fused: the parts are gone
    ours = logits(runner, PROMPT)
    kl = mean_kl(float_logits, ours)
    assert 0 < kl < max_kl
    if quantization == "int8":  # random weights give flat logits: int4 moves their top-1
        assert (ours.argmax(-1) == float_logits.argmax(-1)).float().mean() >= 0.9


def test_int4_serving_equals_float_serving_of_the_same_dequantized_weights(tiny192_dir,
                                                                          tmp_path):
    """What int4 serves is its quantized weights, up to the kernels' bf16 rounding: a float
    checkpoint of the dequantized weights gives the same logits."""
    from safetensors.torch import load_file, save_file

    from slipstream.agent.engine.models.quantization import at_load_format

    dequantized_dir = tmp_path / "dequantized"
    shutil.copytree(tiny192_dir, dequantized_dir)
    tensors = load_file(str(tiny192_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        target = at_load_format(name, "int4")
        if target is not None:
            tensors[name] = quantize(tensor, target, 32).dequantize(torch.float32)
    save_file(tensors, str(dequantized_dir / "model.safetensors"))
    expected = logits(float_runner(dequantized_dir), PROMPT)
    runner = ModelRunner(EngineConfig(model_dir=tiny192_dir, device="cpu", num_kv_blocks=8,
                                      quantization="int4", quantization_group_size=32),
                         ModelConfig.from_dir(tiny192_dir))
    ours = logits(runner, PROMPT)
    assert mean_kl(expected, ours) < 2e-4
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_int8_runs_the_tiny_models_odd_widths(tiny_model_dir):
    """172-wide down projections: the int8 kernel pads its inputs to 16."""
    reference = logits(float_runner(tiny_model_dir), PROMPT)
    runner = ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=8,
                                      quantization="int8"), ModelConfig.from_dir(tiny_model_dir))
    assert mean_kl(reference, logits(runner, PROMPT)) < 1e-3
    with pytest.raises(ValueError, match=r"int4 with group size 32 needs input widths "
                                         r"divisible by it.*172 wide"):
        ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=8,
                                 quantization="int4", quantization_group_size=32),
                    ModelConfig.from_dir(tiny_model_dir))


def test_int4_weights_take_a_fraction_of_the_float_bytes(tiny192_dir):
    config = ModelConfig.from_dir(tiny192_dir)
    dense = load_model(tiny192_dir, CPU, torch.float32, config)
    dense_bytes = weight_bytes(dense)
    assert dense_bytes >= sum(t.numel() * t.element_size() for t in dense.state_dict().values())
    model = load_model(tiny192_dir, CPU, torch.float32, config,
                       weights=WeightSource("int4", 32))
    # int4 group 32 with bf16 scale and zero: 5 bits per weight; the embedding in int8.
    assert weight_bytes(model) < 0.35 * dense_bytes
    assert not any(name.endswith("proj.weight") for name in model.state_dict())


def test_the_engine_generates_from_quantized_weights(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=64,
                                    quantization="int8"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([PROMPT, PROMPT[:5]], params)
    assert [len(tokens) for tokens in outputs] == [8, 8]


def test_start_up_errors_name_the_format_and_what_to_do(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--tp 2: quantized weights run without tensor "
                                         r"parallelism"):
        from slipstream.agent.engine.parallel_config import ParallelConfig

        EngineConfig(model_dir=tiny_model_dir, quantization="int4",
                     parallel=ParallelConfig(tp=2))
    gguf = tmp_path / "model.gguf"
    with pytest.raises(QuantizationError, match="a GGUF file is served in its own formats"):
        resolve_quantization("int8", tiny_model_dir, gguf)
    assert resolve_quantization("auto", tiny_model_dir, gguf) == "gguf"
    assert resolve_quantization("none", tiny_model_dir, gguf) == "none"
    assert resolve_quantization("auto", tiny_model_dir, None) == "none"
    # A checkpoint quantized in a method Slipstream does not read fails at load, in one line.
    quantized_dir = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir, quantized_dir)
    raw = json.loads((quantized_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (quantized_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantizationError, match="already quantized"):
        resolve_quantization("int8", quantized_dir, None)
    with pytest.raises(QuantizationError, match=r"checkpoint quantization 'gptq' is not "
                                                r"supported"):
        ModelRunner(EngineConfig(model_dir=quantized_dir, device="cpu", num_kv_blocks=8),
                    ModelConfig.from_dir(quantized_dir))
    # fp8 on a CPU: no kernel, so no start (never a silent float fallback).
    with pytest.raises(WeightFormatError, match="no CPU kernel"):
        ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=8,
                                 quantization="fp8"), ModelConfig.from_dir(tiny_model_dir))


def test_the_runtime_profile_key_names_the_weight_format(tiny_model_dir, tmp_path):
    from slipstream.agent.engine.profile import auto_profile

    def key(**served):
        config = EngineConfig(model_dir=tiny_model_dir, device="cpu", **served)
        return auto_profile.profile_key(tiny_model_dir, "auto", "cpu", 1, "quick",
                                        served=config)

    dense, int8, int4 = key(), key(quantization="int8"), key(quantization="int4")
    assert (dense.weights, int8.weights, int4.weights) == ("dense", "int8", "int4-g64")
    names = {k.entry_name("tiny") for k in (dense, int8, int4)}
    assert len(names) == 3  # each format gets its own profile
    # Dense keeps the entry name it had before the weight format joined the key.
    assert dense.entry_name("tiny") == auto_profile.profile_key(
        tiny_model_dir, "auto", "cpu", 1, "quick").entry_name("tiny")
    # A GGUF served from its blocks: the key names its block types and hashes the file.
    from tests.engine.test_gguf_quantized import write_gguf

    gguf = tmp_path / "m.gguf"
    write_gguf(gguf, {"output_norm.weight": (np.ones(64, np.float32), "F32"),
                      "blk.0.ffn_up.weight": (np.ones((32, 64), np.float32), "Q4_1")})
    from_file = key(gguf_file=gguf)
    assert from_file.weights == "gguf:F32+Q4_1"
    assert from_file.model_files != dense.model_files
