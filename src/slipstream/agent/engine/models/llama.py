"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5), in reading order: model,
decoder layer, attention, MLP; then norm and rotary embedding (``norm_rope.py``). The other dense families (Qwen3,
Gemma 2/3: ``qwen3.py``, ``gemma.py``) are this decoder with the options of ModelConfig's
family block: QK-norm, Gemma's (1 + weight) norms before and after attention and MLP, a
gelu-tanh MLP, the embedding scale, per-layer sliding windows and local RoPE, and logit
soft-capping.

The model works on a flat token dimension: every sequence's new tokens of this step are
concatenated, with their absolute ``positions``. Attention goes through a backend from
``slipstream.kernels``, which reads and writes the paged KV cache; the model never sees block
tables. Module and parameter names follow Hugging Face, so checkpoints load by name.

Sharding stays out of this file: projections come from a ``LayerFactory`` (plain layers in one
process, tensor-parallel ones under TP) and a ``PipelineStage`` says which decoder layers to
build (SPP). A stage that does not own the embedding takes its input as ``hidden``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.agent.engine.config import ModelConfig
from slipstream.agent.engine.models.layers import LayerFactory, LocalLayers, PipelineStage
from slipstream.agent.engine.models.norm_rope import make_norm, rotary_embeddings, rotate
from slipstream.agent.engine.models.quant_kernels import fuse_quantized
from slipstream.kernels.attention import AttentionBackend

# CPU matmul kernels for two or three rows read the weight once per row, where four rows take
# a blocked kernel that reads it once: for a 32K-vocabulary LM head (100M preset, one core)
# 2, 3 and 4 rows took 15.6, 20.7 and 11.2 ms. Padding to four rows is faster and keeps the
# cost growing with the number of sequences, as the runtime predictor assumes.
MIN_CPU_LOGIT_ROWS = 4

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer: k, v [num_blocks, block, kv_heads, dim]
# Builds decoder layer ``index``'s feed-forward block: the dense MLP here, a mixture of experts
# in models/moe.py. It maps [tokens, hidden] to [tokens, hidden], complete on every TP rank.
MLPFactory = Callable[[ModelConfig, LayerFactory, int], nn.Module]


def dense_mlp(config: ModelConfig, layers: LayerFactory, index: int) -> nn.Module:
    return LlamaMLP(config, layers)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, layers: LayerFactory | None = None,
                 stage: PipelineStage | None = None, *, mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        layers = layers or LocalLayers()
        stage = stage or PipelineStage.whole(config.num_layers)
        self.config = config
        self.model = LlamaModel(config, layers, stage, mlp)
        self.lm_head = layers.lm_head(config.hidden_size, config.vocab_size) \
            if stage.is_last else None
        tie_word_embeddings(self, config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], backend: AttentionBackend,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]``: after the final norm on the last stage,
        else the residual stream to hand to the next stage. ``kv_caches`` holds one entry per
        decoder layer this stage owns."""
        return self.model(input_ids, positions, kv_caches, backend, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.lm_head
        if lm_head is None:
            raise RuntimeError("only the last pipeline stage has the LM head")
        rows = hidden.shape[0]
        if 1 < rows < MIN_CPU_LOGIT_ROWS and type(lm_head) is nn.Linear \
                and hidden.device.type == "cpu":
            padding = hidden.new_zeros(MIN_CPU_LOGIT_ROWS - rows, hidden.shape[1])
            return softcap(lm_head(torch.cat([hidden, padding]))[:rows].float(),
                           self.config.final_logit_softcap)
        return softcap(lm_head(hidden).float(), self.config.final_logit_softcap)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma's soft-capping), or ``logits`` without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def fuse_projections(model: LlamaForCausalLM) -> int:
    """Run q/k/v and gate/up as one matmul each, in every decoder layer whose projections
    are plain ``nn.Linear`` (one process; tensor-parallel layers are left alone). Returns
    the number of layers fused.

    The fused weight is the row-wise concatenation of the parts, and each part's parameter
    becomes a view of its rows, so the memory is not doubled and parameter names and
    ``state_dict`` stay as the checkpoint has them. Each output column is the same dot
    product as before; only the matmul calls change. Why: on a CPU a decode step runs
    thin matmuls, where one call over the concatenated weight reads the input once and
    dispatches once instead of three (or two) times per layer.
    """
    fused = 0
    for layer in cast(list[LlamaDecoderLayer], list(model.model.layers.values())):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, LlamaMLP):  # a mixture of experts stores its own layout
            fused += _fuse_attention(attn)
            continue
        parts: list[nn.Module] = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up: list[nn.Module] = [mlp.gate_proj, mlp.up_proj]
        if not all(type(p) is nn.Linear for p in parts + gate_up):
            # Quantized parts of one format concatenate too (weight_formats.concat_rows).
            attn.qkv_fused = fuse_quantized(parts)
            mlp.gate_up_fused = fuse_quantized(gate_up)
            for owner, names, done in ((attn, ("q_proj", "k_proj", "v_proj"), attn.qkv_fused),
                                       (mlp, ("gate_proj", "up_proj"), mlp.gate_up_fused)):
                for name in names if done is not None else ():
                    setattr(owner, name, None)
            fused += attn.qkv_fused is not None and mlp.gate_up_fused is not None
            continue
        biases = [p.bias is not None for p in parts]
        if all(biases) or not any(biases):
            attn.qkv_weight = _concatenate_rows(parts, "weight")
            attn.qkv_bias = _concatenate_rows(parts, "bias") if all(biases) else None
        mlp.gate_up_weight = _concatenate_rows(gate_up, "weight")
        fused += 1
    return fused


def _fuse_attention(attn: LlamaAttention) -> bool:
    parts: list[nn.Module] = [attn.q_proj, attn.k_proj, attn.v_proj]
    if not all(type(p) is nn.Linear for p in parts):  # quantized (a GGUF's blocks)
        attn.qkv_fused = fuse_quantized(parts)
        for name in ("q_proj", "k_proj", "v_proj") if attn.qkv_fused is not None else ():
            setattr(attn, name, None)
        return attn.qkv_fused is not None
    biases = [p.bias is not None for p in parts]
    if any(biases) and not all(biases):
        return False
    attn.qkv_weight = _concatenate_rows(parts, "weight")
    attn.qkv_bias = _concatenate_rows(parts, "bias") if all(biases) else None
    return True


def _concatenate_rows(modules: list[nn.Module], name: str) -> torch.Tensor:
    """One tensor of the modules' ``name`` parameters stacked along dim 0; each module's
    parameter is replaced by a view of its rows."""
    tensors = [getattr(module, name) for module in modules]
    whole = torch.cat([t.detach() for t in tensors], dim=0)
    start = 0
    for module, tensor in zip(modules, tensors):
        rows = tensor.shape[0]
        setattr(module, name, nn.Parameter(whole[start:start + rows],
                                           requires_grad=tensor.requires_grad))
        start += rows
    return whole


def tie_word_embeddings(model: LlamaForCausalLM, config: ModelConfig) -> None:
    """A model with tied embeddings (and both ends in this stage) shares one weight."""
    embed_tokens, lm_head = model.model.embed_tokens, model.lm_head
    if config.tie_word_embeddings and embed_tokens is not None and lm_head is not None:
        tied_head = getattr(embed_tokens, "tied_lm_head", None)  # a quantized embedding's
        if tied_head is not None:
            model.lm_head = tied_head()
        else:
            lm_head.weight = embed_tokens.weight


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: LayerFactory, stage: PipelineStage,
                 mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = layers.embedding(config.vocab_size, config.hidden_size) \
            if stage.is_first else None
        # Keyed by the global layer index, so parameter names match the checkpoint's.
        self.layers = nn.ModuleDict({str(index): LlamaDecoderLayer(
            config, layers, index, mlp(config, layers, index)) for index in stage.layer_indices})
        self.local_rope = [config.uses_local_rope(index) for index in stage.layer_indices]
        self.norm = make_norm(config, config.hidden_size) if stage.is_last else None
        self.embedding_scale = config.embedding_scale
        self.rotary, self.rotary_local = rotary_embeddings(config)

    def rebuild_rotary(self, config: ModelConfig, device: torch.device) -> None:
        """Rotary buffers made on the meta device (the loader's) made again on ``device``."""
        rotary, local = rotary_embeddings(config)
        self.rotary = rotary.to(device)
        self.rotary_local = local.to(device) if local is not None else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], backend: AttentionBackend,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            hidden = self.embed(input_ids)
        angles = self.angles(positions, hidden.dtype)
        # The residual stream travels beside the layer outputs, so that each norm can add
        # them in the same pass (one kernel on CUDA).
        residual: torch.Tensor | None = None
        for layer, local, kv_cache in zip(self.layers.values(), self.local_rope, kv_caches):
            cos, sin = angles[local]
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, backend)
        return self.finish(hidden, residual)

    # The forward's parts, for the piecewise CUDA graphs of mixed steps (step/mixed_graphs.py),
    # which run everything but attention from graphs: embed, then per layer
    # before_attention / attention / after_attention, then finish.

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise ValueError("a later pipeline stage starts from the previous stage's "
                             "hidden states, not from token ids")
        hidden = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:  # Gemma: the scale rounded to the dtype
            hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        return hidden

    def angles(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """The rotary ``(cos, sin)`` of the positions: ``[True]`` for local-RoPE layers."""
        angles = {False: self.rotary(positions, dtype)}
        if self.rotary_local is not None:  # Gemma 3's sliding layers
            angles[True] = self.rotary_local(positions, dtype)
        return angles

    def finish(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """After the last layer: the final norm of the stream (or, on a pipeline stage
        without it, the stream itself)."""
        if residual is None:  # a stage without layers
            return self.norm(hidden) if self.norm is not None else hidden
        if self.norm is None:  # a pipeline stage hands the whole residual stream on
            return hidden + residual
        return self.norm(hidden, residual)[0]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layers: LayerFactory, index: int = 0,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = make_norm(config, hidden)
        self.self_attn = LlamaAttention(config, layers, index)
        # Llama's post_attention_layernorm is the MLP's input norm; Gemma's ("sandwich") is
        # the attention output's, and the MLP has a norm on each side of its own.
        self.post_attention_layernorm = make_norm(config, hidden)
        self.pre_feedforward_layernorm = make_norm(config, hidden) \
            if config.sandwich_norms else None
        self.post_feedforward_layernorm = make_norm(config, hidden) \
            if config.sandwich_norms else None
        self.mlp = mlp if mlp is not None else LlamaMLP(config, layers)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: KVCache, backend: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``; the caller adds them (the next layer's norm
        does, fused). The first layer gets ``residual=None``: its input is the stream."""
        query, key, value, residual = self.before_attention(hidden, residual, cos, sin)
        attended = self.self_attn.attend(query, key, value, kv_cache, backend)
        return self.after_attention(attended, residual)

    def before_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                         cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input norm, q/k/v and the rotary embedding: ``(query, key, value,
        residual stream)``."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        query, key, value = self.self_attn.qkv(hidden)
        query, key = rotate(query, key, cos, sin)
        return query, key, value, residual

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection of ``attended`` ``[tokens, heads, dim]``, the norms and the
        MLP: ``(mlp output, residual stream)``."""
        attn = self.self_attn
        hidden = attn.o_proj(attended.reshape(attended.shape[0], attn.num_heads * attn.head_dim))
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(
            self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layers: LayerFactory, index: int = 0) -> None:
        super().__init__()
        self.num_heads = layers.local_count(config.num_heads)
        self.num_kv_heads = layers.local_count(config.num_kv_heads)
        self.head_dim = head_dim = config.head_dim
        self.scale = config.attention_scale or 1.0 / math.sqrt(head_dim)
        self.sliding_window = config.sliding_window_of(index)
        self.logit_softcap = config.attn_logit_softcap
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = layers.column_linear(hidden, config.num_heads * head_dim, bias)
        self.k_proj = layers.column_linear(hidden, config.num_kv_heads * head_dim, bias)
        self.v_proj = layers.column_linear(hidden, config.num_kv_heads * head_dim, bias)
        self.o_proj = layers.row_linear(config.num_heads * head_dim, hidden, False)
        # QK-norm before rotary: per head over head_dim (Qwen3, Qwen3-MoE, Gemma 3), or over
        # the whole projection (OLMoE); and OLMoE's clamp.
        qk_norm = config.moe.qk_norm if config.moe is not None else (
            "head" if config.qk_norm else "none")
        q_width = head_dim if qk_norm == "head" else self.num_heads * head_dim
        k_width = head_dim if qk_norm == "head" else self.num_kv_heads * head_dim
        self.qk_norm_per_head = qk_norm == "head"
        self.q_norm = make_norm(config, q_width) if qk_norm != "none" else None
        self.k_norm = make_norm(config, k_width) if qk_norm != "none" else None
        self.clip_qkv = config.moe.clip_qkv if config.moe is not None else None
        # Set by fuse_projections(): q, k and v as one matmul (their weights are views of it).
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        # Set instead by cpu_matmul.pack_cpu_matmuls() (oneDNN-reordered) or, for quantized
        # projections, by fuse_projections(): one module for q/k/v (the parts are dropped).
        self.qkv_fused: nn.Module | None = None

    def qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query ``[tokens, heads, dim]``, key and value ``[tokens, kv_heads, dim]``, before
        the rotary embedding."""
        num_tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if self.qkv_fused is not None:
            query, key, value = self.qkv_fused(hidden).split([q_size, kv_size, kv_size],
                                                                 dim=-1)
        elif self.qkv_weight is not None:
            query, key, value = F.linear(hidden, self.qkv_weight, self.qkv_bias).split(
                [q_size, kv_size, kv_size], dim=-1)
        else:
            query, key, value = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_per_head:
            query, key = self.q_norm(query), self.k_norm(key)
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_per_head:
            query, key = self.q_norm(query), self.k_norm(key)
        if self.clip_qkv is not None:
            clip = self.clip_qkv
            query, key, value = (query.clamp(-clip, clip), key.clamp(-clip, clip),
                                 value.clamp(-clip, clip))
        return query, key, value

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv(hidden)
        query, key = rotate(query, key, cos, sin)
        attended = self.attend(query, key, value, kv_cache, backend)
        return self.o_proj(attended.reshape(num_tokens, self.num_heads * self.head_dim))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: KVCache, backend: AttentionBackend) -> torch.Tensor:
        """Write the new keys and values, and attend: ``[tokens, heads, dim]``."""
        k_cache, v_cache = kv_cache
        backend.write_kv(k_cache, v_cache, key, value)
        return backend.run(query, k_cache, v_cache, self.scale, return_lse=False,
                           sliding_window=self.sliding_window,
                           logit_softcap=self.logit_softcap).output


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layers: LayerFactory,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, intermediate = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = layers.column_linear(hidden, intermediate, False)
        self.up_proj = layers.column_linear(hidden, intermediate, False)
        self.down_proj = layers.row_linear(intermediate, hidden, False)
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {config.hidden_act!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[config.hidden_act]
        # Set by fuse_projections(): gate and up as one matmul (their weights are views of it).
        self.gate_up_weight: torch.Tensor | None = None
        # Set instead by cpu_matmul.pack_cpu_matmuls() or, quantized, by fuse_projections().
        self.gate_up_fused: nn.Module | None = None

    def gate_up(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gate_up_fused is not None:
            gate, up = self.gate_up_fused(hidden).chunk(2, dim=-1)
            return gate, up
        if self.gate_up_weight is not None:
            gate, up = F.linear(hidden, self.gate_up_weight).chunk(2, dim=-1)
            return gate, up
        return self.gate_proj(hidden), self.up_proj(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(hidden)
        return self.down_proj(self.act(gate) * up)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
