"""Hugging Face checkpoints that are quantized already (``quantization.py``): AWQ int4 loads as
it is and serves what its integers say; compressed-tensors fp8 reads back exactly and, on a
CPU, stops the start with one line (no silent float fallback)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.models.quant_kernels import WeightFormatError, kernel_of
from slipstream.agent.engine.models.weight_formats import Fp8Weight, quantize_fp8, quantize_int4
from slipstream.agent.engine.models.quantization import read_quantized_checkpoint
from slipstream.agent.engine.models.tiny_model import PRESETS, write_tiny_model
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk

GROUP = 32
PROMPT = [7, 99, 1023, 5, 42, 300, 301, 302, 17, 18, 19, 2000, 3, 4]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing order


@pytest.fixture(scope="module")
def tiny192_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny192"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PRESETS, "tiny192", replace(PRESETS["tiny"], intermediate_size=192))
        write_tiny_model(path, "tiny192", seed=1)
    return path


def awq_pack(columns: torch.Tensor) -> torch.Tensor:
    """int [rows, cols] in 0..15 -> int32 [rows, cols/8], as AutoAWQ's WQLinear_GEMM packs."""
    packed = torch.zeros(columns.shape[0], columns.shape[1] // 8, dtype=torch.int32)
    for block in range(packed.shape[1]):
        for position, column in enumerate(AWQ_ORDER):
            packed[:, block] |= columns[:, block * 8 + column].to(torch.int32) << (4 * position)
    return packed


def logits(model_dir: Path) -> torch.Tensor:
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=4),
                         ModelConfig.from_dir(model_dir))
    chunk = ScheduledChunk("r", tuple(PROMPT), 0, (0,), True)
    return runner.compute_logits(Batch(chunks=(chunk,)))


def with_config(source: Path, target: Path, tensors: dict, quantization_config: dict) -> Path:
    shutil.copytree(source, target)
    save_file(tensors, str(target / "model.safetensors"))
    raw = json.loads((target / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(raw))
    return target


def test_an_awq_checkpoint_serves_what_its_integers_say(tiny192_dir, tmp_path):
    float_tensors = load_file(str(tiny192_dir / "model.safetensors"))
    awq, dequantized = {}, dict(float_tensors)
    for name, tensor in float_tensors.items():
        if not name.endswith("proj.weight"):
            awq[name] = tensor
            continue
        weight = quantize_int4(tensor, GROUP)
        # AWQ keeps integer zero points: round our minimum onto one (q - zero) * scale.
        zeros = torch.round(-weight.minimum / weight.scale).clamp(0, 15)
        values = weight.unpacked()
        prefix = name.removesuffix(".weight")
        awq[prefix + ".qweight"] = awq_pack(values.T.contiguous())
        awq[prefix + ".qzeros"] = awq_pack(zeros.T.contiguous().to(torch.int32))
        awq[prefix + ".scales"] = weight.scale.T.contiguous().to(torch.float16)
        scale = weight.scale.to(torch.float16).float()
        groups = values.float().view(values.shape[0], -1, GROUP)
        dequantized[name] = ((groups - zeros[..., None]) * scale[..., None]).view_as(tensor)
    awq_dir = with_config(tiny192_dir, tmp_path / "awq", awq,
                          {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                           "zero_point": True, "version": "gemm"})
    reference_dir = tmp_path / "dequantized"
    shutil.copytree(tiny192_dir, reference_dir)
    save_file(dequantized, str(reference_dir / "model.safetensors"))

    runner = ModelRunner(EngineConfig(model_dir=awq_dir, device="cpu", num_kv_blocks=4),
                         ModelConfig.from_dir(awq_dir))
    assert "int4-g32" in (kernel_of(runner.model.model.layers["0"].mlp.down_proj) or "")
    chunk = ScheduledChunk("r", tuple(PROMPT), 0, (0,), True)
    ours = runner.compute_logits(Batch(chunks=(chunk,)))
    expected = logits(reference_dir)
    p, q = expected.log_softmax(-1), ours.log_softmax(-1)
    assert float((p.exp() * (p - q)).sum(-1).mean()) < 2e-4  # bf16 activations only
    # Random weights give flat logits, so a near-tie may flip; a wrong unpacking flips most.
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.85


def fp8_checkpoint(source: Path, target: Path) -> Path:
    tensors = load_file(str(source / "model.safetensors"))
    stored = {}
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            weight = quantize_fp8(tensor)
            stored[name] = weight.values
            stored[name.removesuffix(".weight") + ".weight_scale"] = weight.scale[:, None]
        else:
            stored[name] = tensor
    return with_config(source, target, stored, {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "type": "float", "num_bits": 8, "strategy": "channel"}}}})


def test_an_fp8_checkpoint_reads_back_exactly_and_stops_a_cpu_start(tiny192_dir, tmp_path):
    fp8_dir = fp8_checkpoint(tiny192_dir, tmp_path / "fp8")
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as shard:
        names = list(shard.keys())
        weights = dict(read_quantized_checkpoint(fp8_dir, shard, names))
    name = "model.layers.1.mlp.up_proj.weight"
    assert isinstance(weights[name], Fp8Weight)
    expected = quantize_fp8(load_file(str(tiny192_dir / "model.safetensors"))[name])
    torch.testing.assert_close(weights[name].dequantize(torch.float32),
                               expected.dequantize(torch.float32), rtol=0, atol=0)
    assert not any(key.endswith("weight_scale") for key in weights)
    with pytest.raises(WeightFormatError, match=r"fp8-channel weights have no CPU kernel: "
                                                r"serve this checkpoint on a GPU"):
        ModelRunner(EngineConfig(model_dir=fp8_dir, device="cpu", num_kv_blocks=4),
                    ModelConfig.from_dir(fp8_dir))
