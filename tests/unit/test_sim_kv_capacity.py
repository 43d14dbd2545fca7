"""The simulator's KV capacity from a profile's model shape: a mixture of experts stores every
expert, so the same GPU holds fewer KV tokens than for its dense twin."""

from __future__ import annotations

from slipstream.agent.scheduler.profile_table import ProfileMeta
from slipstream.sim.kv_capacity import estimate_kv_blocks

# Mixtral-8x7B's shape.
DENSE = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 32000}
MIXTURE = {**DENSE, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 14336, "num_sparse_layers": 32}


def test_every_expert_is_counted_in_the_weights():
    dense = estimate_kv_blocks(ProfileMeta(num_layers=32, model=DENSE), 8, 1, 1)
    mixture = estimate_kv_blocks(ProfileMeta(num_layers=32, model=MIXTURE), 8, 1, 1)
    # Per GPU (tp 8): seven more experts per layer in bf16, and KV of 32 layers x 1 KV head x
    # 128 dims x K and V x 2 bytes per token; the gap in tokens is one over the other.
    extra_weights_per_gpu = 32 * 7 * 3 * 4096 * 14336 * 2 / 8 + 32 * 4096 * 8 * 2 / 8
    kv_bytes_per_token_per_gpu = 32 * 1 * 128 * 2 * 2
    assert mixture < dense
    assert abs((dense - mixture) * 16 - extra_weights_per_gpu / kv_bytes_per_token_per_gpu) \
        <= 16
