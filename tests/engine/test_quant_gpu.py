"""Quantized linear layers on CUDA (GPU only; skipped without CUDA, never run on the CPU
development machine): tinygemm int4, int8 and fp8 ``torch._scaled_mm`` kernels against the
float32 reference of the same quantized weight; a model quantized at load decoding from CUDA
graphs gives the tokens of its eager self, with no host synchronisation inside the forward.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.models.quant_kernels import (Fp8ScaledMM, Int4Tinygemm,
                                                          QuantLinear, TwoInt4Planes,
                                                          WeightFormatError, select_kernel)
from slipstream.agent.engine.models.weight_formats import (
    Int8GroupWeight, quantize_fp8, quantize_int4, quantize_int8, reference_linear, to_device)
from slipstream.contracts.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def close_to_reference(kernel, weight, rows: int, columns: int) -> None:
    hidden = torch.randn(rows, columns, device=CUDA, dtype=torch.bfloat16)
    reference = reference_linear(hidden.float(), weight).float()
    ours = kernel(hidden).float()
    scale = float(reference.abs().max())
    torch.testing.assert_close(ours, reference, rtol=3e-2, atol=3e-2 * scale)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_tinygemm_int4_matches_the_reference(group, rows):
    weight = to_device(quantize_int4(torch.randn(512, 1024), group), CUDA)
    close_to_reference(Int4Tinygemm(weight), weight, rows, 1024)


def test_int8_on_cuda_matches_the_reference():
    weight = to_device(quantize_int8(torch.randn(384, 512)), CUDA)
    close_to_reference(select_kernel(weight, CUDA), weight, 5, 512)
    values = torch.randint(-127, 128, (256, 512), dtype=torch.int8)
    grouped = to_device(Int8GroupWeight(values, torch.rand(256, 16) / 100, 32), CUDA)
    kernel = select_kernel(grouped, CUDA)
    assert isinstance(kernel, TwoInt4Planes)
    close_to_reference(kernel, grouped, 3, 512)


@pytest.mark.skipif(not fp8_capable(), reason="fp8 needs compute capability 8.9+")
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("rows", [1, 16, 33])
def test_scaled_mm_fp8_matches_the_reference(per_channel, rows):
    weight = to_device(quantize_fp8(torch.randn(256, 512), per_channel), CUDA)
    hidden = torch.randn(rows, 512, device=CUDA, dtype=torch.bfloat16)
    reference = reference_linear(hidden.float(), weight)
    ours = Fp8ScaledMM(weight, CUDA)(hidden).float()
    # e4m3 activations: about 2 significant digits per element, averaged over 512 products.
    torch.testing.assert_close(ours, reference, rtol=6e-2, atol=6e-2 * float(reference.abs().max()))


@pytest.mark.skipif(fp8_capable(), reason="this GPU runs fp8")
def test_fp8_on_an_older_gpu_stops_with_a_message():
    layer = QuantLinear(quantize_fp8(torch.randn(64, 64)))
    with pytest.raises(WeightFormatError, match="compute capability 8.9"):
        layer.prepare(CUDA)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_graph_decoding_equals_eager_decoding(tmp_path, quantization):
    if quantization == "fp8" and not fp8_capable():
        pytest.skip("fp8 needs compute capability 8.9+")
    from slipstream.agent.engine.models.tiny_model import write_tiny_model

    model_dir = tmp_path / "model"
    write_tiny_model(model_dir, "100m", seed=0)  # widths divisible by 64 and 16
    prompts = [[7, 99, 1023, 5, 42] * 3, list(range(300, 337))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for graphs in (False, True):
        engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cuda", dtype="bfloat16",
                                        num_kv_blocks=256, quantization=quantization,
                                        quantization_group_size=64, cuda_graphs=graphs))
        model = engine.runner.model  # type: ignore[attr-defined]
        # Nothing in the eager forward may wait for the GPU (the graphs capture the same code).
        hooks = [model.register_forward_pre_hook(
                     lambda *_: torch.cuda.set_sync_debug_mode("error")),
                 model.register_forward_hook(
                     lambda *_: torch.cuda.set_sync_debug_mode("default"))]
        try:
            outputs[graphs] = engine.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for hook in hooks:
                hook.remove()
            engine.close()
    assert outputs[True] == outputs[False]
