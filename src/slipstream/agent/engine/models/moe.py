"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the Llama-family
decoder of ``llama.py`` whose feed-forward block is, on the sparse layers, a router over
experts.

    hidden [tokens, H] --router--> top-k experts and weights per token
        --GroupedExperts: sort the (token, expert) pairs by expert, one SwiGLU matmul pair per
          expert that got tokens--> weighted sum per token
        --ExpertShard.reduce (TP and EP ranks)--> + gated shared expert (Qwen2-MoE)

Attention, norms and the rotary embedding are ``llama.py``'s; the families' QK-norm is an
option of its attention (``moe_config.MoESettings.qk_norm``). Experts are stored as
transformers 5 stores them, gate and up fused: ``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]``; checkpoints with one tensor per expert (every published one)
are stacked at load by ``stack_expert_tensors``.

Numerics follow transformers: the router's softmax in float32, top-k, optional division by
the top-k sum, and each token's expert outputs summed in expert order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.agent.engine.config import ModelConfig
from slipstream.agent.engine.models.layers import ExpertShard, LayerFactory, PipelineStage
from slipstream.agent.engine.models.llama import LlamaForCausalLM, LlamaMLP


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, layers: LayerFactory | None = None,
                 stage: PipelineStage | None = None) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture} has no mixture-of-experts settings")
        super().__init__(config, layers, stage, mlp=moe_or_dense_mlp)


def moe_or_dense_mlp(config: ModelConfig, layers: LayerFactory, index: int) -> nn.Module:
    if config.moe is not None and config.moe.is_sparse(index):
        return SparseMoeBlock(config, layers)
    return LlamaMLP(config, layers)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layers: LayerFactory) -> None:
        super().__init__()
        settings = config.moe
        assert settings is not None
        self.top_k, self.norm_topk_prob = settings.top_k, settings.norm_topk_prob
        # The router is small and every rank needs all of its scores: replicated.
        self.gate = nn.Linear(config.hidden_size, settings.num_experts, bias=False)
        self.shard = layers.expert_shard(settings.num_experts)
        self.experts = GroupedExperts(settings.num_experts, config.hidden_size,
                                      settings.expert_intermediate_size, self.shard)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if settings.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, layers,
                                          settings.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert ids [tokens, k], weights [tokens, k])``."""
        probabilities = F.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(hidden.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.route(hidden)
        routed = self.experts(hidden, expert_ids, weights)
        if self.shard.reduce is not None:
            self.shard.reduce(routed)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(hidden)
            routed = routed + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return routed


class GroupedExperts(nn.Module):
    """This rank's experts (``shard``): SwiGLU MLPs with gate and up as one matrix each.

    The forward sorts the (token, expert) pairs by expert and runs each local expert that got
    tokens once, over all its tokens: the Python loop is over experts (at most
    ``num_local``), never over tokens. Its output is this rank's partial sum; the caller
    reduces it over the ranks.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 shard: ExpertShard) -> None:
        super().__init__()
        self.holds_all = shard.num_local == num_experts
        if intermediate_size % shard.tp_size:
            raise ValueError(f"the experts' intermediate size ({intermediate_size}) must be "
                             f"divisible by the TP degree ({shard.tp_size})")
        local_intermediate = intermediate_size // shard.tp_size
        self.shard = shard
        self.gate_up_proj = nn.Parameter(torch.empty(shard.num_local, 2 * local_intermediate,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(shard.num_local, hidden_size,
                                                  local_intermediate))

    def forward(self, hidden: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = expert_ids.shape
        local_ids = expert_ids.flatten() - self.shard.first_expert
        pair_tokens = torch.arange(num_tokens, device=hidden.device).repeat_interleave(top_k)
        pair_weights = weights.flatten()
        if not self.holds_all:  # expert parallel: keep the pairs routed to this rank
            here = (local_ids >= 0) & (local_ids < self.shard.num_local)
            local_ids, pair_tokens, pair_weights = (local_ids[here], pair_tokens[here],
                                                    pair_weights[here])
        order = torch.argsort(local_ids, stable=True)
        tokens = pair_tokens[order]
        # One host sync per layer: the segment sizes decide the matmul shapes.
        counts = torch.bincount(local_ids, minlength=self.shard.num_local).tolist()
        gathered = hidden.index_select(0, tokens)
        outputs = torch.empty_like(gathered)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            segment = gathered[start:start + count]
            gate, up = F.linear(segment, self.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs[start:start + count] = F.linear(F.silu(gate) * up, self.down_proj[expert])
            start += count
        outputs = outputs * pair_weights[order].unsqueeze(-1)
        # index_add_ visits the pairs in expert order, so each token's sum runs in expert
        # order as transformers' does.
        return torch.zeros_like(hidden).index_add_(0, tokens, outputs)

    def shard_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts, and under TP its slice of each one's intermediate width."""
        shard = self.shard
        part = full[shard.first_expert:shard.first_expert + shard.num_local]
        if shard.tp_size == 1:
            return part
        if name == "gate_up_proj":
            gate, up = part.chunk(2, dim=1)
            return torch.cat([gate.chunk(shard.tp_size, dim=1)[shard.tp_rank],
                              up.chunk(shard.tp_size, dim=1)[shard.tp_rank]], dim=1)
        return part.chunk(shard.tp_size, dim=2)[shard.tp_rank]


# Per-expert checkpoint names: Mixtral's w1 (gate), w3 (up), w2 (down) under
# block_sparse_moe, and Qwen-MoE / OLMoE's gate_proj, up_proj, down_proj under mlp.
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|"
    r"down_proj)\.weight$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
         "down_proj": "down"}
Source = TypeVar("Source")


def stack_expert_tensors(tensors: Iterator[tuple[str, str, Source]], num_experts: int
                         ) -> Iterator[tuple[str, str, Source | torch.Tensor]]:
    """The checkpoint's tensors with Mixtral's ``block_sparse_moe`` renamed ``mlp`` and each
    layer's per-expert tensors stacked into ``experts.gate_up_proj`` and
    ``experts.down_proj`` once all of that layer's have been read."""
    pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for source, name, tensor in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            yield source, name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{source}: {name} is quantized; quantized experts are not "
                             "supported yet (serve the float checkpoint)")
        prefix, expert = match["prefix"], int(match["expert"])
        if expert >= num_experts:
            raise ValueError(f"{source}: {name} names expert {expert}, but the config has "
                             f"{num_experts}")
        parts = pending.setdefault(prefix, {})
        parts[(_PART[match["part"]], expert)] = tensor
        if len(parts) == 3 * num_experts:
            del pending[prefix]
            yield source, f"{prefix}.gate_up_proj", torch.stack([
                torch.cat([parts[("gate", e)], parts[("up", e)]]) for e in range(num_experts)])
            yield source, f"{prefix}.down_proj", torch.stack(
                [parts[("down", e)] for e in range(num_experts)])
    for prefix, parts in pending.items():
        raise ValueError(f"the checkpoint has {len(parts)} of the {3 * num_experts} expert "
                         f"tensors of {prefix}")
