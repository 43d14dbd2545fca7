"""The mixture-of-experts part of a runtime profile: what the time-budget packer and the
simulator charge for a sparse layer.

    profiler.linear_ops --> "moe_block" (ms per sparse layer, keyed by batch tokens) and the
        dense MLP ops (per dense layer) --> op_counts_per_layer weighs each by the share of
        layers it runs on --> RuntimePredictor.linear_ms (scheduler/predictor.py)

A sparse layer is timed as what it runs: the router, the dispatch (sort by expert, gather,
weighted scatter back), the SwiGLU of each expert that got tokens and the shared expert. At
one token that is top-k experts' weights, at 32 tokens on 8 experts nearly all of them; the
table carries that curve, so nothing assumes the dense FLOPs of all experts, nor only
top-k's. ``active_parameters_per_token`` and ``expected_experts_hit`` state the same cost in
closed form (for the profile's description and the benchmark's report).
"""

from __future__ import annotations

from slipstream.agent.engine.config import ModelConfig

DENSE_MLP_OPS = ("mlp_up_proj", "mlp_act", "mlp_down_proj")
MOE_OP = "moe_block"


def mlp_op_counts(config: ModelConfig) -> dict[str, float]:
    """op -> calls per layer, averaged over the layers (a dense op runs on dense layers only)."""
    if config.moe is None:
        return {}
    sparse = len(config.moe.sparse_layers(config.num_layers))
    share = sparse / config.num_layers
    return {MOE_OP: share, **{op: 1.0 - share for op in DENSE_MLP_OPS}}


def expected_experts_hit(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Experts that get at least one of ``num_tokens`` tokens when routing is uniform."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def active_parameters_per_token(config: ModelConfig) -> int:
    """Weights one token reads in a forward, without the embedding: attention and norms of
    every layer, the router plus top-k experts plus the shared expert on sparse layers, the
    dense MLP on the others, and the LM head."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    dense_mlp = 3 * hidden * config.intermediate_size
    total = config.num_layers * attention + config.vocab_size * hidden
    moe = config.moe
    sparse = moe.sparse_layers(config.num_layers) if moe is not None else []
    total += (config.num_layers - len(sparse)) * dense_mlp
    if moe is not None:
        expert = 3 * hidden * moe.expert_intermediate_size
        shared = 3 * hidden * moe.shared_expert_intermediate_size + (
            hidden if moe.shared_expert_intermediate_size else 0)
        total += len(sparse) * (hidden * moe.num_experts + moe.top_k * expert + shared)
    return total


def moe_model_fields(config: ModelConfig) -> dict:
    """The profile's description of a mixture (profile.json ``model``); {} for a dense model."""
    moe = config.moe
    if moe is None:
        return {}
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
            "num_sparse_layers": len(moe.sparse_layers(config.num_layers)),
            "active_parameters_per_token": active_parameters_per_token(config)}
