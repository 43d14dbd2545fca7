"""``slipstream make-tiny-model``: a small random-weight Llama in Hugging Face format.

No model can be downloaded where Slipstream is built and tested, so tests, benchmarks on CPU
and the embedded default of ``slipstream serve`` use a model written here. The directory has
the same files as a real Llama 3 checkpoint (``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), so the loader and the
tokenizer take exactly the code path they take for a real one, and ``transformers`` loads it
too, which is what the engine's correctness tests compare against.

Everything is deterministic: the tokenizer is trained on the embedded text of
``tiny_corpus.py``; the weights come from ``torch.Generator`` seeded with ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT_VERSION = 1  # bump when the files written here change, so cached defaults are rebuilt
STAMP_FILE = "slipstream-tiny-model.json"
CACHE_DIR_ENV = "SLIPSTREAM_CACHE_DIR"
DEFAULT_MODEL_NAME = "tiny-llama-seed0"

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
END_OF_TURN = "<|eot_id|>"
NAMED_SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, END_OF_TURN)
MIN_RESERVED_SPECIAL_TOKENS = 11  # like Llama 3's <|reserved_special_token_N|>, padded to 16

# The Llama 3 pre-tokenizer split: contractions, letter runs with one leading non-letter,
# numbers of at most three digits, punctuation runs, and whitespace.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3 style. A content given as a list of OpenAI parts is reduced to its text parts.
CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown chat role: ' ~ message['role']) }}
    {%- endif %}
    {%- if message['content'] is string %}
        {%- set content = message['content'] %}
    {%- else %}
        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')
                                             | map(attribute='text') | join('') %}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""


@dataclass(frozen=True)
class TinyModelPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 500_000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < 256 + len(NAMED_SPECIAL_TOKENS) + MIN_RESERVED_SPECIAL_TOKENS:
            raise ValueError("vocab_size must hold the 256 byte tokens and the special tokens")


PRESETS: dict[str, TinyModelPreset] = {
    # About 0.7M parameters (2.8 MB): fast enough for every CPU test.
    "tiny": TinyModelPreset(hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=4096, max_position_embeddings=131_072),
    # About 110M parameters: big enough for meaningful GPU timings.
    "100m": TinyModelPreset(hidden_size=768, intermediate_size=1536, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                            vocab_size=32_000, max_position_embeddings=131_072),
    # Llama-3-8B's body (32 layers of hidden 4096, 32 heads, 8 KV heads, MLP 14336) with this
    # tokenizer's 4,096-token vocabulary: 7.0B parameters, 14.0 GB in bf16. Written without
    # weights (--no-weights) and served with --load-format dummy, as `make device-check` does.
    "llama3-8b-body": TinyModelPreset(hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128, vocab_size=4096,
                                      max_position_embeddings=131_072),
}


@dataclass(frozen=True)
class SpecialTokenIds:
    begin_of_text: int
    end_of_text: int
    end_of_turn: int


def build_tokenizer(vocab_size: int):
    """Train a Llama-3-style byte-level BPE with exactly ``vocab_size`` tokens.

    The special tokens take the last ids, as in Llama 3. If the corpus runs out of merges
    before the target size, the gap is filled with reserved special tokens.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors, trainers

    from slipstream.agent.engine.models.tiny_corpus import training_corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    num_bpe_tokens = vocab_size - len(NAMED_SPECIAL_TOKENS) - MIN_RESERVED_SPECIAL_TOKENS
    # All 256 byte symbols are in the alphabet, so any UTF-8 text encodes losslessly.
    trainer = trainers.BpeTrainer(vocab_size=num_bpe_tokens, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_corpus(num_made_up_words=2 * vocab_size), trainer)

    num_reserved = vocab_size - tokenizer.get_vocab_size() - len(NAMED_SPECIAL_TOKENS)
    specials = list(NAMED_SPECIAL_TOKENS)
    specials += [f"<|reserved_special_token_{index}|>" for index in range(num_reserved)]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in specials])
    bos_id = tokenizer.token_to_id(BEGIN_OF_TEXT)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BEGIN_OF_TEXT}:0 $A:0",
            pair=f"{BEGIN_OF_TEXT}:0 $A:0 {BEGIN_OF_TEXT}:1 $B:1",
            special_tokens=[(BEGIN_OF_TEXT, bos_id)]),
    ])
    if tokenizer.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    return tokenizer


def special_token_ids(tokenizer) -> SpecialTokenIds:
    return SpecialTokenIds(begin_of_text=tokenizer.token_to_id(BEGIN_OF_TEXT),
                           end_of_text=tokenizer.token_to_id(END_OF_TEXT),
                           end_of_turn=tokenizer.token_to_id(END_OF_TURN))


def hf_config(preset: TinyModelPreset, ids: SpecialTokenIds) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": preset.max_position_embeddings,
        "vocab_size": preset.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": ids.begin_of_text,
        "eos_token_id": [ids.end_of_text, ids.end_of_turn],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def tokenizer_config(preset: TinyModelPreset, tokenizer) -> dict:
    added = {str(token_id): {"content": token.content, "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True}
             for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN_OF_TEXT,
        "eos_token": END_OF_TURN,
        "pad_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": preset.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added,
    }


def parameter_shapes(preset: TinyModelPreset) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama parameter names and shapes, in a fixed order."""
    hidden, q_size = preset.hidden_size, preset.num_attention_heads * preset.head_dim
    kv_size = preset.num_key_value_heads * preset.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (preset.vocab_size, hidden)}
    for layer in range(preset.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_size, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_size, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_size, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_size)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (preset.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (preset.intermediate_size, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, preset.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (preset.vocab_size, hidden)
    return shapes


def random_weights(preset: TinyModelPreset, seed: int) -> dict:
    """Deterministic random weights: the same seed gives the same bytes.

    Embeddings use std 0.02. Projections use std 1/sqrt(fan_in), so that each layer's
    output, the attention scores and the logits have a spread of order one: a model whose
    attention is uniform would hide RoPE or GQA bugs from the equivalence tests. Norm
    weights are 1 plus small noise, so that a norm applied with the wrong weight shows.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(preset).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.05 * noise
        elif name == "model.embed_tokens.weight":
            weights[name] = 0.02 * noise
        else:
            weights[name] = noise / shape[1] ** 0.5
    return weights


def count_parameters(preset: TinyModelPreset) -> int:
    total = 0
    for shape in parameter_shapes(preset).values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Files whose stale copies would change what a loader reads (index files win over our single
# safetensors file; a chat_template.jinja wins over tokenizer_config.json's template).
_STALE_FILES = ("model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "chat_template.jinja", "tokenizer.model")


def write_tiny_model(out_dir: str | Path, preset_name: str = "tiny", seed: int = 0,
                     force: bool = False, preset: TinyModelPreset | None = None,
                     weights: bool = True) -> list[Path]:
    """Write the model directory and return the files written. Refuses a non-empty
    directory unless ``force`` (then our files are overwritten and stale weights removed).
    ``preset`` (a benchmark's own shape) overrides ``preset_name``. ``weights=False`` writes
    the config and tokenizer only, for ``--load-format dummy``."""
    if preset is None:
        if preset_name not in PRESETS:
            raise ValueError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset_name]
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise FileExistsError(f"{out_dir} is not empty; pass --force to overwrite")
        for name in _STALE_FILES:
            (out_dir / name).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)

    from safetensors.torch import save_file

    tokenizer = build_tokenizer(preset.vocab_size)
    ids = special_token_ids(tokenizer)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(preset, tokenizer))
    _write_json(out_dir / "config.json", hf_config(preset, ids))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids.begin_of_text,
        "eos_token_id": [ids.end_of_text, ids.end_of_turn],
    })
    if weights:
        save_file(random_weights(preset, seed), str(out_dir / "model.safetensors"),
                  metadata={"format": "pt"})
    _write_json(out_dir / STAMP_FILE, {"format_version": FORMAT_VERSION, "preset": preset_name,
                                       "seed": seed, "preset_config": asdict(preset)})
    return sorted(path for path in out_dir.iterdir() if path.is_file())


def slipstream_cache_dir() -> Path:
    """Where Slipstream keeps generated files (converted models, runtime profiles):
    ``$SLIPSTREAM_CACHE_DIR``, else the user cache directory of the XDG base directory spec,
    ``$XDG_CACHE_HOME/slipstream`` (``~/.cache/slipstream`` when that is unset). The only place
    that reads the variables."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The spec says a relative path is invalid and is to be ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "slipstream"


def _is_current(model_dir: Path) -> bool:
    try:
        stamp = json.loads((model_dir / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return stamp.get("format_version") == FORMAT_VERSION


def ensure_default_model() -> Path:
    """Return the embedded default model (tiny preset, seed 0), writing it on first use.

    It is built in a temporary directory and renamed into place, so a concurrent caller sees
    either no model or a complete one; the loser of a race keeps the winner's copy.
    """
    target = slipstream_cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        write_tiny_model(staging, "tiny", seed=0)
        if target.exists():  # an outdated format: move it aside, then replace it
            outdated = Path(tempfile.mkdtemp(prefix=".outdated-", dir=target.parent))
            os.replace(target, outdated / "model")
            shutil.rmtree(outdated, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_current(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", type=Path,
                        help="output directory (created; must be empty unless --force)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights; the same seed gives identical files")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="size: 'tiny' (~0.7M parameters, a few MB), '100m' (~110M "
                             "parameters, for GPU timings) or 'llama3-8b-body' (Llama-3-8B's "
                             "layers with a 4,096-token vocabulary, 7.0B parameters)")
    parser.add_argument("--no-weights", dest="weights", action="store_false",
                        help="write config.json and the tokenizer only; serve it with "
                             "--load-format dummy (random weights made on the device)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty directory, overwriting the model files")


def run(args: argparse.Namespace) -> int:
    try:
        files = write_tiny_model(args.dir, args.preset, seed=args.seed, force=args.force,
                                 weights=args.weights)
    except (FileExistsError, ValueError) as error:
        print(f"slipstream make-tiny-model: error: {error}", file=sys.stderr)
        return 2
    preset = PRESETS[args.preset]
    what = "a random-weight Llama" if args.weights else \
        "the config and tokenizer of a Llama (serve with --load-format dummy)"
    print(f"Wrote {what} ({args.preset}, seed {args.seed}, "
          f"{count_parameters(preset):,} parameters, vocab {preset.vocab_size}) to {args.dir}:")
    total_bytes = 0
    for path in files:
        size_bytes = path.stat().st_size
        total_bytes += size_bytes
        print(f"  {path.name:28s} {size_bytes:>14,d} bytes")
    print(f"  {'total':28s} {total_bytes:>14,d} bytes ({total_bytes / 2**20:.1f} MiB)")
    return 0
