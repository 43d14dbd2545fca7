"""What differs between the GGUF architectures Slipstream reads: llama, qwen2, qwen3, gemma2,
gemma3 (dense text models), and the mixture-of-experts ones (Mixtral as llama with experts,
qwen2moe, qwen3moe, olmoe: their fields and tensors are in ``gguf_moe.py``).

    gguf_model.hf_config   general.architecture + "{arch}.*" metadata -> config.json fields
                           (family_fields adds each family's own)
    hf_tensor_name         blk.N.<gguf name> -> the Hugging Face name, by architecture
    restore_tensor         undo what llama.cpp's converter changed in a tensor: llama's Q/K
                           rows permuted for its RoPE layout; Gemma's norm weights stored as
                           1 + w (Slipstream, as transformers, stores w and adds the 1)

Names and metadata keys follow llama.cpp's ``convert_hf_to_gguf.py`` and the ``gguf``
library's constants (``MODEL_TENSORS``, ``Keys.LLM``/``Keys.Attention``).
"""

from __future__ import annotations

from typing import Any

from slipstream.agent.engine.models.gguf_moe import (MOE_ARCHITECTURES, GGUFMoEError,
                                                     expert_tensor_name, moe_fields,
                                                     moe_layer_tensors, moe_model_type)

# GGUF architecture -> (model_type, class name) of the config.json written for it.
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    **MOE_ARCHITECTURES,
}

_LLAMA_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_LAYER = {**_LLAMA_LAYER, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
LAYER_TENSORS: dict[str, dict[str, str]] = {
    "llama": _LLAMA_LAYER, "mistral": _LLAMA_LAYER, "qwen2": _LLAMA_LAYER,
    "qwen3": {**_LLAMA_LAYER, **_QK_NORM},
    "gemma2": _GEMMA_LAYER, "gemma3_text": {**_GEMMA_LAYER, **_QK_NORM},
    "mixtral": moe_layer_tensors(_LLAMA_LAYER), "qwen2_moe": moe_layer_tensors(_LLAMA_LAYER),
    "qwen3_moe": moe_layer_tensors({**_LLAMA_LAYER, **_QK_NORM}),
    "olmoe": moe_layer_tensors({**_LLAMA_LAYER, **_QK_NORM}),
}
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                  "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# llama.cpp's Gemma graphs use 1/sqrt(hidden / heads) as the attention scale for the 27B
# models (46 layers in Gemma 2, 62 in Gemma 3) and 1/sqrt(head_dim) for the others: the
# query_pre_attn_scalar of their config.json, which llama.cpp's GGUFs do not store (a file
# with ``{arch}.attention.scale`` says it).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


class GGUFArchitectureError(ValueError):
    pass


def family_fields(arch: str, key: Any, metadata: dict[str, Any],
                  shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """config.json fields of ``arch`` beyond Llama's; ``key(name, default)`` reads
    ``{arch}.{name}`` from the metadata (raising when absent without a default); ``shapes``:
    the tensors' shapes by GGUF name (which layers hold experts)."""
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFArchitectureError(f"GGUF architecture {arch!r} is not supported yet; "
                                    f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    model_type, class_name = moe_model_type(arch, metadata) or GGUF_ARCHITECTURES[arch]
    fields: dict[str, Any] = {"architectures": [class_name], "model_type": model_type,
                              "attention_bias": arch in ("qwen2", "qwen2moe")}
    if model_type in _MOE_TYPES:
        try:
            return {**fields, **moe_fields(arch, key, metadata, shapes or {})}
        except GGUFMoEError as error:
            raise GGUFArchitectureError(str(error)) from None
    if not arch.startswith("gemma"):
        return fields
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    layers = key("block_count")
    fields.update(
        hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
        sliding_window=int(key("attention.sliding_window")),
        query_pre_attn_scalar=_query_pre_attn_scalar(arch, metadata, hidden // heads, head_dim,
                                                     layers),
        final_logit_softcapping=_float_or_none(metadata.get(f"{arch}.final_logit_softcapping")),
        attn_logit_softcapping=_float_or_none(metadata.get(f"{arch}.attn_logit_softcapping")))
    if arch == "gemma3":
        # The pattern is a period (one global layer in every 6, llama.cpp's default) or one
        # flag per layer (True: sliding); the local RoPE base defaults to 10,000 likewise.
        pattern = metadata.get("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            fields["layer_types"] = ["sliding_attention" if flag else "full_attention"
                                     for flag in pattern]
        else:
            fields["sliding_window_pattern"] = int(pattern)
        fields["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10_000.0))
    return fields


def _query_pre_attn_scalar(arch: str, metadata: dict[str, Any], hidden_per_head: int,
                           head_dim: int, layers: int) -> float:
    """The attention scale's inverse square: from ``{arch}.attention.scale`` when the file
    has it, else llama.cpp's rule (``_GEMMA_27B_LAYERS``)."""
    scale = metadata.get(f"{arch}.attention.scale")
    if scale:
        return round(float(scale) ** -2, 3)  # stored as float32: 24 comes back as 23.99999
    return hidden_per_head if layers == _GEMMA_27B_LAYERS[arch] else head_dim


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def hf_tensor_name(name: str, model_type: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    layer_tensors = LAYER_TENSORS[model_type]
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".", 3)
        if model_type in _MOE_TYPES:
            try:
                expert = expert_tensor_name(layer, kind, suffix)
            except GGUFMoEError as error:
                raise GGUFArchitectureError(str(error)) from None
            if expert is not None:
                return expert
        if kind not in layer_tensors:
            raise GGUFArchitectureError(f"unexpected tensor {name!r} in a {model_type} GGUF")
        return f"model.layers.{layer}.{layer_tensors[kind]}.{suffix}"
    if name == "rope_freqs.weight":
        raise GGUFArchitectureError("per-dimension RoPE factors (rope_freqs, Llama 3.1 "
                                    "scaling) in a GGUF are not supported yet")
    raise GGUFArchitectureError(f"unexpected tensor {name!r} in a {model_type} GGUF")


def norm_weight_offset(name: str, model_type: str) -> float:
    """What llama.cpp added to this tensor (Gemma's norms: 1), to subtract again."""
    return 1.0 if model_type.startswith("gemma") and name.endswith("norm.weight") else 0.0


def rope_rows_permuted(name: str, model_type: str) -> str | None:
    """Which head count un-permutes this tensor's rows ("num_attention_heads" for Q,
    "num_key_value_heads" for K), or None: llama.cpp permutes only the llama
    architecture's Q/K weights, Mixtral's included (the others use its NeoX RoPE layout, as
    transformers)."""
    if model_type not in ("llama", "mistral", "mixtral"):
        return None
    if name.endswith("attn_q.weight"):
        return "num_attention_heads"
    if name.endswith("attn_k.weight"):
        return "num_key_value_heads"
    return None
