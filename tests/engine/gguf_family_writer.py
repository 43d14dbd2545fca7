"""A Hugging Face directory of a dense family written as a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` writes it: tensor names from the ``gguf`` library's own map, Gemma's
norm weights stored as 1 + w, the architecture's metadata keys, and the byte-level BPE
vocabulary of ``tokenizer.json``. Used by the GGUF round-trip tests of the families."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}


def write_family_gguf(model_dir: Path, path: Path) -> Path:
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    arch_enum = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    global_rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(global_rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(config["sliding_window"])
        # llama.cpp leaves the scale to its per-size rule; this writer stores it, so the
        # tiny models' deliberately odd query_pre_attn_scalar survives.
        writer.add_attention_scale(config["query_pre_attn_scalar"] ** -0.5)
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_sliding_window_pattern([kind == "sliding_attention"
                                           for kind in config["layer_types"]])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    add_tokenizer(writer, model_dir, config)
    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        assert target is not None, name
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1.0
        writer.add_tensor(f"{target}.{suffix}", np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tokenizer["model"]["vocab"])
    special = set()
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
        special.add(added["id"])
    tokens = [""] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if index in special else 1 for index in range(len(tokens))])
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"]
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
