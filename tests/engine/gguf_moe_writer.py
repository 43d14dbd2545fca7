"""A Hugging Face mixture-of-experts directory (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) written
as a GGUF file the way llama.cpp's ``convert_hf_to_gguf.py`` writes it: the per-expert tensors
stacked into ``ffn_{gate,up,down}_exps`` [E, rows, columns] (or, for older Mixtral files, one
``ffn_gate.E`` tensor per expert), names from the ``gguf`` library's own map, the Q/K rows of
the ``llama`` architecture permuted for its RoPE, the shared-expert gate stored as [H], and
the metadata keys its converter writes for each architecture.

Qwen2-MoE's dense layers (``mlp_only_layers``, which llama.cpp's converter has no name for in
``qwen2moe``) are written as ``ffn_gate``/``ffn_up``/``ffn_down``, the dense FFN names of every
other architecture."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tests.engine.gguf_family_writer import add_tokenizer

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "olmoe": "olmoe"}
_EXPERT = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:block_sparse_moe|mlp)\.experts\."
                     r"(?P<expert>\d+)\.(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
         "down_proj": "down"}
_PROJECTIONS = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
_DENSE = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_moe_gguf(model_dir: Path, path: Path, expert_types: dict[str, str] | None = None,
                   per_expert: bool = False, projection_type: str = "F32",
                   widths_in_metadata: bool = True, extra_metadata=None) -> Path:
    """``expert_types``: GGML type per expert part ("gate", "up", "down"; F32 if absent);
    ``per_expert``: one tensor per expert (llama.cpp's Mixtral files before stacking);
    ``projection_type``: the GGML type of the other projections (attention, dense and shared
    MLPs) and the LM head; ``widths_in_metadata=False`` leaves out the experts' widths (as
    older converters did); ``extra_metadata(writer)`` adds keys."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    arch_enum = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    _add_metadata(writer, config, widths_in_metadata)
    if extra_metadata is not None:
        extra_metadata(writer)
    add_tokenizer(writer, model_dir, config)
    experts = config.get("num_local_experts") or config["num_experts"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    pending: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        match = _EXPERT.match(name)
        if match is not None:
            layer, part = int(match["layer"]), _PART[match["part"]]
            kind = (expert_types or {}).get(part, "F32")
            if per_expert:
                _add(writer, f"blk.{layer}.ffn_{part}.{match['expert']}.weight", array, kind)
                continue
            stack = pending.setdefault((layer, part), {})
            stack[int(match["expert"])] = array
            if len(stack) == experts:
                target = names.get_name(f"model.layers.{layer}.mlp.experts.{part}_proj")
                _add(writer, f"{target}.weight", np.stack([stack[e] for e in range(experts)]),
                     kind)
            continue
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if target is None:  # a dense layer of a Qwen2-MoE
            prefix, _, module = base.partition(".mlp.")
            target = f"blk.{prefix.rsplit('.', 1)[1]}.{_DENSE['mlp.' + module]}"
        if arch == "llama" and base.endswith("q_proj"):
            array = _permute(array, heads)
        elif arch == "llama" and base.endswith("k_proj"):
            array = _permute(array, kv_heads)
        if base.endswith("shared_expert_gate"):
            array = array.reshape(-1)  # [1, H] -> [H], as llama.cpp's converter stores it
        _add(writer, f"{target}.{suffix}", array,
             projection_type if is_projection(name) else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def is_projection(name: str) -> bool:
    """A linear layer's weight other than the routed experts' and the routers'."""
    return name == "lm_head.weight" or (name.endswith(_PROJECTIONS) and not _EXPERT.match(name))


def _add_metadata(writer, config: dict, widths: bool) -> None:
    model_type = config["model_type"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if model_type in ("qwen2_moe", "qwen3_moe") and widths:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if model_type == "qwen2_moe" and widths:
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if model_type == "olmoe" and config.get("clip_qkv"):
        writer.add_clamp_kqv(config["clip_qkv"])


def _add(writer, name: str, array: np.ndarray, kind: str) -> None:
    import gguf

    array = np.ascontiguousarray(array, dtype=np.float32)
    if kind == "F32":
        writer.add_tensor(name, array)
        return
    quant = gguf.GGMLQuantizationType[kind]
    writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's two RoPE halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_dequantized_reference(model_dir: Path, out_dir: Path, expert_types: dict[str, str],
                                projection_type: str = "F32") -> Path:
    """``model_dir`` with each tensor that ``write_moe_gguf`` quantizes with these types
    replaced by what the ``gguf`` library's dequantizer returns for it: the model such a GGUF
    holds, for transformers to load. (Quantization runs along rows, so llama.cpp's Q/K row
    permutation does not change the values.)"""
    import gguf

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, array in tensors.items():
        match = _EXPERT.match(name)
        kind = expert_types.get(_PART[match["part"]], "F32") if match else \
            projection_type if is_projection(name) else "F32"
        if kind != "F32":
            quant = gguf.GGMLQuantizationType[kind]
            tensors[name] = np.ascontiguousarray(
                gguf.quants.dequantize(gguf.quants.quantize(array, quant), quant),
                dtype=np.float32)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
