"""The MoE cost model's closed forms against real models and real routing: active parameters
per token counted from transformers' own parameters, the profile's op weights, and the
expected number of experts a batch reaches."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from slipstream.agent.engine.config import ModelConfig
from slipstream.agent.engine.profile.moe_profile import (active_parameters_per_token,
                                                 expected_experts_hit, mlp_op_counts)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_active_parameters_count_top_k_experts_and_the_shared_expert(moe_model_dirs, family):
    config = ModelConfig.from_dir(moe_model_dirs[family])
    model = AutoModelForCausalLM.from_pretrained(moe_model_dirs[family], dtype=torch.float32)
    moe = config.moe
    assert moe is not None
    total = sum(p.numel() for name, p in model.named_parameters()
                if "embed_tokens" not in name and "norm" not in name and ".bias" not in name)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    # Every expert is stored; a token reads top_k of each sparse layer's num_experts.
    unread = experts * (moe.num_experts - moe.top_k) // moe.num_experts
    assert active_parameters_per_token(config) == total - unread


def test_op_weights_follow_the_share_of_sparse_layers(moe_model_dirs):
    qwen2 = ModelConfig.from_dir(moe_model_dirs["qwen2_moe"])  # layer 1 of 3 is dense
    counts = mlp_op_counts(qwen2)
    assert counts["moe_block"] == pytest.approx(2 / 3)
    assert counts["mlp_up_proj"] == pytest.approx(1 / 3)
    assert mlp_op_counts(ModelConfig.from_dir(moe_model_dirs["mixtral"]))["moe_block"] == 1.0


def test_expected_experts_hit_matches_uniform_routing():
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 4, 32):
        hits = [len(torch.unique(torch.stack([torch.randperm(8, generator=generator)[:2]
                                              for _ in range(tokens)])))
                for _ in range(400)]
        assert sum(hits) / len(hits) == pytest.approx(expected_experts_hit(tokens, 8, 2),
                                                      rel=0.05)
    assert expected_experts_hit(1, 8, 2) == pytest.approx(2.0)
