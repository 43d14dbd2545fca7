"""The mixture-of-experts part of a model's configuration, read from ``config.json``.

    config.json --moe_settings()--> MoESettings (on ModelConfig.moe) --> models/moe.py

One shape covers Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE; they differ in field names and in a
few switches (renormalised top-k weights, a gated shared expert, which layers are sparse, and
where the attention's QK-norm sits). A dense model has no MoESettings at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.agent.engine.config import ModelConfig
    from slipstream.agent.engine.parallel_config import ParallelConfig

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # models/registry.py


@dataclass(frozen=True)
class MoESettings:
    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int
    # Divide the top-k softmax weights by their sum (Mixtral always does).
    norm_topk_prob: bool
    # Qwen2-MoE's shared expert, added to every token behind a sigmoid gate; 0: none.
    shared_expert_intermediate_size: int = 0
    # Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in
    # mlp_only_layers; the others keep a dense MLP of the model's intermediate_size.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Attention options these families bring (dense Qwen3 brings "head" too):
    # "head": RMSNorm of each head's q and k (Qwen3-MoE); "full": RMSNorm over the whole q and
    # k projections (OLMoE); "none".
    qk_norm: str = "none"
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the "
                             f"number of experts ({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be at least 1, got "
                             f"{self.decoder_sparse_step}")
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"qk_norm must be none, head or full, got {self.qk_norm!r}")

    def is_sparse(self, layer: int) -> bool:
        return (layer + 1) % self.decoder_sparse_step == 0 and layer not in self.mlp_only_layers

    def sparse_layers(self, num_layers: int) -> list[int]:
        return [layer for layer in range(num_layers) if self.is_sparse(layer)]


def moe_settings(model_type: str, raw: dict[str, Any]) -> MoESettings | None:
    """The MoE settings of a ``config.json`` (``raw``), or None for a dense model: keyed by
    ``model_type``, the same key that picks the model class (models/registry.py)."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} with hidden_act {raw['hidden_act']!r} is not "
                         "supported (the experts run SwiGLU)")
    # transformers 5 writes num_local_experts for every family; published Qwen and OLMoE
    # configs say num_experts.
    num_experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
    if model_type == "mixtral":
        return MoESettings(num_experts=num_experts,
                           top_k=raw.get("num_experts_per_tok", 2),
                           expert_intermediate_size=raw["intermediate_size"],
                           norm_topk_prob=True)
    if model_type in ("qwen3_moe", "olmoe") \
            and raw.get("attention_bias", False):
        raise ValueError(f"{model_type} with attention_bias (a bias on o_proj too) is not "
                         "supported")
    if model_type == "olmoe":
        return MoESettings(num_experts=num_experts, top_k=raw.get("num_experts_per_tok", 8),
                           expert_intermediate_size=raw["intermediate_size"],
                           norm_topk_prob=raw.get("norm_topk_prob", False),
                           qk_norm="full", clip_qkv=raw.get("clip_qkv"))
    return MoESettings(
        num_experts=num_experts,
        top_k=raw.get("num_experts_per_tok", 8),
        expert_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=raw.get("norm_topk_prob", False),
        shared_expert_intermediate_size=(raw.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        qk_norm="head" if model_type == "qwen3_moe" else "none")


def check_expert_fit(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ValueError, in one line naming the flag, when the experts cannot be split as
    ``--ep`` and ``--tp`` ask (config.check_parallel_fit calls it before workers start)."""
    moe = model.moe
    if moe is None:
        if parallel.ep > 1:
            raise ValueError(f"--ep {parallel.ep}: {model.architecture} has no experts to "
                             "split (expert parallelism is for mixture-of-experts models)")
        return
    if moe.num_experts % parallel.ep:
        fitting = [d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]
        raise ValueError(f"--ep {parallel.ep} does not divide this model's {moe.num_experts} "
                         f"experts (--ep may be {', '.join(map(str, fitting))})")
    tp = parallel.tp
    for what, width in (("experts' intermediate size", moe.expert_intermediate_size),
                        ("shared expert's intermediate size",
                         moe.shared_expert_intermediate_size)):
        if width % tp:
            raise ValueError(f"--tp {tp} does not divide the {what} ({width})")
    if tp > 1 and moe.qk_norm == "full":
        raise ValueError(f"--tp {tp}: {model.architecture}'s QK-norm spans every head, which "
                         "tensor parallelism splits; serve it with --tp 1 (and --ep for "
                         "the experts)")
