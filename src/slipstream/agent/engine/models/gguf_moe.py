"""The mixture-of-experts side of GGUF files: Mixtral (architecture ``llama`` with
``llama.expert_count``), ``qwen2moe``, ``qwen3moe`` and ``olmoe``.

    metadata                                    -> config.json (moe_config.py reads it)
      {arch}.expert_count, expert_used_count    -> num_experts / num_local_experts, top-k
      {arch}.expert_feed_forward_length         -> moe_intermediate_size (Qwen)
      {arch}.expert_shared_feed_forward_length  -> shared_expert_intermediate_size (Qwen2-MoE)
      {arch}.expert_weights_norm                -> norm_topk_prob (else llama.cpp's per-arch rule)
      {arch}.attention.clamp_kqv                -> clip_qkv (OLMoE)
      layers without ffn_gate_inp               -> mlp_only_layers (dense layers)
    tensors
      blk.N.ffn_gate_inp                        -> mlp.gate (the router)
      blk.N.ffn_gate_exps, ffn_up_exps [E, I, H] -> mlp.experts.gate_up_proj [E, 2I, H]
      blk.N.ffn_down_exps [E, H, I]             -> mlp.experts.down_proj
      blk.N.ffn_{gate,up,down}.E                -> mlp.experts.E.{gate,up,down}_proj (older
                                                   Mixtral files; moe.stack_expert_tensors
                                                   stacks them at load)
      blk.N.ffn_{gate,up,down}_shexp            -> mlp.shared_expert.*
      blk.N.ffn_gate_inp_shexp [H]              -> mlp.shared_expert_gate [1, H]

Expert stacks in the file are [E, rows, columns] per expert, the layout ``models/moe.py``
keeps; gate and up are concatenated per expert (gate rows first), as transformers 5 does.
The metadata keys are the ones llama.cpp's ``convert_hf_to_gguf.py`` writes (``gguf``'s
``Keys.LLM``); where a file lacks one, the width is read from the tensors' shapes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

# GGUF architecture -> (model_type, class name). Mixtral is ``llama`` with experts.
MOE_ARCHITECTURES = {
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
}
MIXTRAL = ("mixtral", "MixtralForCausalLM")
# llama.cpp's graphs divide the top-k weights by their sum for these (its norm_w argument)
# unless the file says otherwise in {arch}.expert_weights_norm.
_NORM_TOPK_BY_ARCH = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
_SOFTMAX_GATING = 1  # gguf.ExpertGatingFuncType.SOFTMAX

_MOE_LAYER = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked experts: gate and up are fused by fuse_expert_stacks.
_STACKED = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_PER_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_PER_EXPERT_SUFFIX = re.compile(r"^(?P<expert>\d+)\.weight$")


class GGUFMoEError(ValueError):
    pass


def moe_model_type(arch: str, metadata: dict[str, Any]) -> tuple[str, str] | None:
    """(model_type, class name) when ``arch`` is a mixture of experts, else None."""
    if arch in MOE_ARCHITECTURES:
        return MOE_ARCHITECTURES[arch]
    if arch == "llama" and int(metadata.get("llama.expert_count") or 0) > 0:
        return MIXTRAL
    return None


def moe_fields(arch: str, key: Any, metadata: dict[str, Any],
               shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """config.json's MoE fields for ``arch``. ``key(name, default)`` reads ``{arch}.{name}``;
    ``shapes``: each tensor's Hugging Face-order shape by GGUF name (for widths a file
    leaves out and for the dense layers)."""
    model_type, _ = moe_model_type(arch, metadata) or (None, None)
    gating = metadata.get(f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise GGUFMoEError(f"{arch} GGUF with expert gating function {gating} (not softmax) "
                           "is not supported")
    experts, top_k = int(key("expert_count")), int(key("expert_used_count"))
    norm_topk = bool(metadata.get(f"{arch}.expert_weights_norm", _NORM_TOPK_BY_ARCH[arch]))
    layers = int(key("block_count"))
    sparse = [layer for layer in range(layers) if f"blk.{layer}.ffn_gate_inp.weight" in shapes]
    if shapes and not sparse:
        raise GGUFMoEError(f"the {arch} GGUF has expert_count {experts} but no layer has a "
                           "router (blk.N.ffn_gate_inp)")
    expert_width = _width(key, "expert_feed_forward_length", shapes, sparse, "ffn_gate_exps")
    if model_type == "mixtral":
        if not norm_topk:
            raise GGUFMoEError("a llama GGUF with experts and expert_weights_norm false is "
                               "not supported (Mixtral renormalises its top-k weights)")
        if len(sparse) != layers and shapes:
            raise GGUFMoEError("a llama GGUF with experts must have them on every layer")
        return {"num_local_experts": experts, "num_experts_per_tok": top_k,
                "intermediate_size": expert_width or key("feed_forward_length")}
    fields: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": top_k,
                              "norm_topk_prob": norm_topk}
    if model_type == "olmoe":
        if len(sparse) != layers and shapes:
            raise GGUFMoEError("an olmoe GGUF must have experts on every layer")
        clamp = metadata.get(f"{arch}.attention.clamp_kqv")
        return {**fields, "intermediate_size": expert_width or key("feed_forward_length"),
                "clip_qkv": float(clamp) if clamp else None}
    if expert_width is None:
        raise GGUFMoEError(f"the GGUF has no {arch}.expert_feed_forward_length")
    fields.update(moe_intermediate_size=expert_width, decoder_sparse_step=1,
                  mlp_only_layers=[layer for layer in range(layers) if layer not in sparse]
                  if shapes else [])
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = _width(
            key, "expert_shared_feed_forward_length", shapes, sparse, "ffn_gate_shexp") or 0
        fields["use_sliding_window"] = False
    return fields


def _width(key: Any, name: str, shapes: dict[str, tuple[int, ...]], sparse: list[int],
           tensor: str) -> int | None:
    """An intermediate width from the metadata, else from a sparse layer's tensor (its
    rows: ``[E, I, H]`` for expert stacks, ``[I, H]`` for the shared expert)."""
    value = key(name, 0)
    if value:
        return int(value)
    for layer in sparse:
        shape = shapes.get(f"blk.{layer}.{tensor}.weight")
        if shape is not None:
            return int(shape[-2])
    return None


def moe_layer_tensors(base: dict[str, str]) -> dict[str, str]:
    """A dense layer's GGUF -> Hugging Face names plus the MoE ones (dense layers of a MoE
    model keep ``ffn_gate``/``ffn_up``/``ffn_down``)."""
    return {**base, **_MOE_LAYER}


def expert_tensor_name(layer: str, kind: str, suffix: str) -> str | None:
    """The Hugging Face name of a routed-experts tensor: ``blk.N.ffn_down_exps.weight`` ->
    ``model.layers.N.mlp.experts.down_proj`` (gate and up stacks under names that
    fuse_expert_stacks fuses), ``blk.N.ffn_gate.E.weight`` (older Mixtral files) ->
    ``model.layers.N.mlp.experts.E.gate_proj.weight``; None for any other tensor."""
    if kind in _STACKED:
        if suffix != "weight":
            raise GGUFMoEError(f"unexpected tensor blk.{layer}.{kind}.{suffix}")
        return f"model.layers.{layer}.mlp.experts.{_STACKED[kind]}"
    match = _PER_EXPERT_SUFFIX.match(suffix)
    if match is None or kind not in _PER_EXPERT:
        return None
    return f"model.layers.{layer}.mlp.experts.{match['expert']}.{_PER_EXPERT[kind]}.weight"


def is_expert_tensor(name: str) -> bool:
    """A GGUF tensor that holds routed experts (stacked, or one expert of an older file)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "blk":
        return False
    return parts[2] in _STACKED or (parts[2] in _PER_EXPERT and parts[3].isdigit())


def kept_float(name: str) -> bool:
    """A tensor the engine runs in float whatever its type in the file: routed experts
    (``models/moe.py`` has no quantized expert kernel), routers and the shared-expert gate
    (small, and kept unquantized by llama.cpp's own quantizer)."""
    return is_expert_tensor(name) or ".ffn_gate_inp." in name or ".ffn_gate_inp_shexp." in name


def model_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the model gives a GGUF tensor of ``shape`` (Hugging Face order): the
    shared-expert gate is stored as [H] by llama.cpp's converter, [1, H] in the model."""
    if ".ffn_gate_inp_shexp." in name and len(shape) == 1:
        return (1, *shape)
    return shape


Tensor = TypeVar("Tensor")


def fuse_expert_stacks(tensors: Iterable[tuple[str, Tensor]], concat: Any
                       ) -> Iterator[tuple[str, Tensor]]:
    """The tensors with each layer's ``mlp.experts.gate_proj`` and ``up_proj`` stacks
    replaced by one ``mlp.experts.gate_up_proj``: ``concat(gate, up)`` must join them along
    each expert's rows (dimension 1). Yielded once both have been read."""
    pending: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".experts.")
        if not prefix or part not in ("gate_proj", "up_proj"):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == 2:
            del pending[prefix]
            yield f"{prefix}.experts.gate_up_proj", concat(parts["gate_proj"], parts["up_proj"])
    for prefix, parts in pending.items():
        missing = "ffn_up_exps" if "gate_proj" in parts else "ffn_gate_exps"
        raise GGUFMoEError(f"the GGUF lacks {missing} of {prefix.replace('model.layers.', 'blk.')}")
