"""q/k/v and gate/up run as one matmul each after loading (``fuse_projections``): the same
outputs, the same parameter names, no second copy of the weights."""

from __future__ import annotations

import torch

from slipstream.agent.engine.config import ModelConfig
from slipstream.agent.engine.models.loader import load_model
from slipstream.agent.engine.models.llama import LlamaForCausalLM, fuse_projections
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.kernels.attention import AttentionMetadata
from slipstream.kernels.torch_ref import TorchReferenceBackend


def _unfused(model_dir, config: ModelConfig) -> LlamaForCausalLM:
    """The same checkpoint with separate projections: the fused fields cleared."""
    model = load_model(model_dir, torch.device("cpu"), torch.float32, config)
    for layer in model.model.layers.values():
        layer.self_attn.qkv_weight = layer.self_attn.qkv_bias = None
        layer.mlp.gate_up_weight = None
    return model


def _prefill_logits(model: LlamaForCausalLM, config: ModelConfig, prompt: list[int]
                    ) -> torch.Tensor:
    blocks = -(-len(prompt) // BLOCK_SIZE)
    shape = (blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    backend = TorchReferenceBackend()
    backend.plan(AttentionMetadata.build(
        query_lens=[len(prompt)], kv_lens=[len(prompt)], query_start_pos=[0],
        block_tables=[list(range(blocks))], slot_mapping=list(range(len(prompt))),
        block_size=BLOCK_SIZE))
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), caches, backend)
        return model.compute_logits(hidden)


def test_loaded_model_is_fused_and_keeps_its_parameters(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    model = load_model(tiny_model_dir, torch.device("cpu"), torch.float32, config)
    reference = _unfused(tiny_model_dir, config)
    assert set(model.state_dict()) == set(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    layer = next(iter(model.model.layers.values()))
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.qkv_weight is not None and mlp.gate_up_weight is not None
    # The parts are views of the fused weight: one copy in memory.
    fused_ptr, row_bytes = attn.qkv_weight.data_ptr(), attn.qkv_weight.stride(0) * 4
    assert attn.q_proj.weight.data_ptr() == fused_ptr
    assert attn.k_proj.weight.data_ptr() == fused_ptr + attn.q_proj.weight.shape[0] * row_bytes
    assert mlp.up_proj.weight.data_ptr() == (mlp.gate_up_weight.data_ptr()
                                             + mlp.gate_proj.weight.shape[0]
                                             * mlp.gate_up_weight.stride(0) * 4)


def test_fused_model_computes_what_the_separate_projections_compute(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    fused = load_model(tiny_model_dir, torch.device("cpu"), torch.float32, config)
    unfused = _unfused(tiny_model_dir, config)
    prompt = [7, 99, 1023, 5, 42, 300, 301, 17, 2, 2, 9]
    torch.testing.assert_close(_prefill_logits(fused, config, prompt),
                               _prefill_logits(unfused, config, prompt), rtol=0, atol=1e-5)


def test_tensor_parallel_style_layers_are_left_alone(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    model = _unfused(tiny_model_dir, config)

    class Sharded(torch.nn.Linear):  # anything but a plain nn.Linear (TP layers)
        pass

    layer = next(iter(model.model.layers.values()))
    plain = layer.self_attn.q_proj
    sharded = Sharded(plain.in_features, plain.out_features, bias=plain.bias is not None)
    layer.self_attn.q_proj = sharded
    assert fuse_projections(model) == config.num_layers - 1
    assert layer.self_attn.qkv_weight is None and layer.mlp.gate_up_weight is None
