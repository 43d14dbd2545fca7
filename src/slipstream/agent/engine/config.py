"""Configuration of the engine: the model's architecture (read from a Hugging Face
``config.json``) and the engine's own knobs. Both are frozen and validated once, then passed
explicitly to everything that needs them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.agent.config.engine_sections import (
    DEFAULT_SHORT_PREFILL_BATCH_SIZES, DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS)
from slipstream.agent.engine.disagg_config import DisaggConfig
from slipstream.agent.engine.kv.memory import KVCacheMemory
from slipstream.agent.engine.kv.tier_settings import KVTierSettings
from slipstream.agent.engine.models.registry import SUPPORTED_MODEL_TYPES, model_type_of
from slipstream.agent.engine.moe_config import MoESettings, check_expert_fit, moe_settings
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.scheduler.config import SchedulerConfig

SLIDING, FULL = "sliding_attention", "full_attention"  # config.json's layer_types values


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    model_type: str = "llama"  # config.json's; picks the model class (models/registry.py)
    # -- Family options (Qwen3, Gemma 2, Gemma 3); the defaults are Llama's -------------------
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm per head on q and k, before rotary
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # Gemma: norms on the attention and MLP outputs too
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (Gemma)
    embedding_scale: float | None = None  # Gemma: the embeddings times sqrt(hidden_size)
    attention_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5; else dim's
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2 (Gemma 3 when set): the same on logits
    # Per layer, "sliding_attention" (keys within sliding_window of the query) or
    # "full_attention"; empty: every layer slides when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base
    # Mixture-of-experts: the router, experts and shared expert (moe_config.py); None for a
    # dense model.
    moe: MoESettings | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs config.json, "
                                    "*.safetensors and tokenizer.json")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} should hold a JSON object")
        try:
            return cls.from_dict(raw)
        except KeyError as error:
            raise ValueError(f"{path} lacks {error.args[0]!r}") from None
        except (TypeError, ZeroDivisionError) as error:
            raise ValueError(f"{path} has a field of the wrong kind: {error}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = model_type_of(raw)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        architecture = next(iter(raw.get("architectures") or []), model_type)
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        # transformers 5 moved rope settings into "rope_parameters"; older configs use
        # rope_theta + rope_scaling. Accept both.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope = dict(rope.get(FULL) or rope)  # Gemma 3: per layer type; the global layers'
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported yet")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", raw.get(
                "qkv_bias", model_type == "qwen2")),  # Qwen2-MoE: qkv_bias
            rope_scaling=RopeScaling(
                rope_type=rope_type,
                factor=rope.get("factor", 1.0),
                low_freq_factor=rope.get("low_freq_factor", 1.0),
                high_freq_factor=rope.get("high_freq_factor", 4.0),
                original_max_position_embeddings=rope.get("original_max_position_embeddings",
                                                          8192),
            ),
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or "float32",
            model_type=model_type,
            **family_options(model_type, raw, sliding),
            moe=moe_settings(model_type, raw),
        )

    def sliding_window_of(self, layer: int) -> int | None:
        """The window (in tokens, the query's own included) of decoder layer ``layer``, or
        None where it attends to every earlier token."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    def uses_local_rope(self, layer: int) -> bool:
        return self.rope_local_theta is not None and self.sliding_window_of(layer) is not None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, at 4 bytes per element (fp32)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def family_options(model_type: str, raw: dict[str, Any], sliding: int | None) -> dict[str, Any]:
    """The ModelConfig fields beyond Llama's that ``model_type`` sets from config.json."""
    num_layers = raw["num_hidden_layers"]
    layer_types = tuple(raw.get("layer_types") or ())
    if model_type in ("qwen2", "qwen3") and sliding and not layer_types:
        # transformers' rule: the layers from max_window_layers on slide.
        first = raw.get("max_window_layers", num_layers)
        layer_types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    options: dict[str, Any] = {"layer_types": layer_types}
    if model_type == "qwen3":
        options["qk_norm"] = True
    if model_type.startswith("gemma"):
        if not layer_types:
            # Older configs: Gemma 2 slides on even layers; Gemma 3 has one global layer
            # in every sliding_window_pattern.
            pattern = raw.get("sliding_window_pattern", 2 if model_type == "gemma2" else 6)
            layer_types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING
                                for i in range(num_layers))
        options.update(
            layer_types=layer_types, norm_weight_offset=1.0, sandwich_norms=True,
            hidden_act=raw.get("hidden_activation") or "gelu_pytorch_tanh",
            embedding_scale=raw["hidden_size"] ** 0.5,
            attention_scale=raw.get("query_pre_attn_scalar", raw.get("head_dim", 256)) ** -0.5,
            attn_logit_softcap=raw.get("attn_logit_softcapping"),
            final_logit_softcap=raw.get("final_logit_softcapping"),
            qk_norm=model_type != "gemma2",
            rope_local_theta=None if model_type == "gemma2" else local_rope_theta(raw))
    if len(options["layer_types"]) not in (0, num_layers) or \
            set(options["layer_types"]) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {SLIDING!r} or {FULL!r} for each of the "
                         f"{num_layers} layers")
    return options


def local_rope_theta(raw: dict[str, Any]) -> float:
    """Gemma 3's sliding layers' RoPE base: transformers 5 keeps it in rope_parameters."""
    local = (raw.get("rope_parameters") or {}).get(SLIDING) or {}
    return local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))


DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS = (32, 64, 128, 256, 512)
DEFAULT_SHORT_PREFILL_BATCH_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ShortPrefillBuckets:
    """The (length, batch) shapes a batch of fresh short prefills is padded to (PLA-Serve's
    power-of-two grid). With ``EngineConfig.short_prefill_graphs`` one CUDA graph is captured per
    (length, batch) pair on CUDA; on CPU the same padded path runs eagerly.

    ``max_padding_factor`` keeps a batch on the eager path when its bucket would hold more
    than that many padded tokens per real token (one long prompt among many tiny ones would
    otherwise replay a graph mostly made of padding).
    """

    lengths_tokens: tuple[int, ...] = DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS
    batch_sizes: tuple[int, ...] = DEFAULT_SHORT_PREFILL_BATCH_SIZES
    max_padding_factor: float = 4.0

    def __post_init__(self) -> None:
        for name in ("lengths_tokens", "batch_sizes"):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            if not values:
                raise ValueError(f"short-prefill {name} must not be empty")
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"short-prefill {name} must be positive integers, got {values}")
            if list(values) != sorted(set(values)):
                raise ValueError(f"short-prefill {name} must be strictly increasing, got {values}")
        if not self.max_padding_factor >= 1.0:
            raise ValueError("max_padding_factor must be at least 1 (a bucket holds every "
                             f"real token), got {self.max_padding_factor}")

    @property
    def num_buckets(self) -> int:
        return len(self.lengths_tokens) * len(self.batch_sizes)


def check_parallel_fit(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ValueError, in one line naming the flag, when the model cannot be split as
    asked; checked before any worker process starts (a worker would fail the same way,
    later, with a traceback per rank)."""
    tp = parallel.tp
    if model.num_heads % tp or model.num_kv_heads % tp or model.intermediate_size % tp:
        fitting = [d for d in range(1, model.num_kv_heads + 1)
                   if not (model.num_heads % d or model.num_kv_heads % d
                           or model.intermediate_size % d)]
        raise ValueError(
            f"--tp {tp} does not divide this model: it has {model.num_heads} attention heads, "
            f"{model.num_kv_heads} KV heads and an MLP of {model.intermediate_size}, which "
            f"every TP rank must share equally (--tp may be "
            f"{', '.join(str(d) for d in fitting)})")
    check_expert_fit(model, parallel)
    if parallel.spp > model.num_layers:
        raise ValueError(f"--spp {parallel.spp} is more pipeline stages than this model has "
                         f"layers ({model.num_layers})")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    num_kv_blocks: int | None = None  # fixed; default: sized by kv_cache_memory
    # A share of the free memory or a size (see kv_memory.py); default: the device's share.
    kv_cache_memory: KVCacheMemory = field(default_factory=KVCacheMemory)
    seed: int = 0
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer (kernels/attention.py)
    # Where the weights come from: the checkpoint's safetensors, or "dummy": random weights
    # of the checkpoint's shapes made on the device (benchmarks of models too large to ship).
    load_format: str = "safetensors"
    # CPU matmuls: auto | onednn (weights reordered once at load) | torch (F.linear); auto is
    # oneDNN for float32 on CPU when PyTorch has it (models/cpu_matmul.py).
    cpu_matmul: str = "auto"
    # Weight format (quantization.py): auto (a GGUF's own blocks, a quantized checkpoint as
    # stored, else float) | none | int8 | int4 | fp8 (a float checkpoint quantized at load).
    quantization: str = "auto"
    quantization_group_size: int = 64  # int4's group along the input (32, 64 or 128)
    # A GGUF file served quantized: model_dir then holds only its config and tokenizer.
    gguf_file: Path | None = None
    # How a GGUF's blocks meet the activations: bf16 (the packed kernels) or q8 (llama.cpp's
    # 8-bit activation blocks, a float32 GEMM; models/q8_activations.py). A measurement
    # switch for the llama.cpp comparison, not a serve flag: it did not make tokens match.
    gguf_activations: str = "bf16"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tp x spp x kvp ranks
    # A profile directory (``slipstream profile``) turns on the time-budget packer; without
    # one the scheduler packs a plain token budget of max_batched_tokens.
    profile_dir: Path | None = None
    # With no profile_dir: measure one (or read the cached one) before the engine is built
    # (auto_profile.with_runtime_profile; `slipstream serve` without --profile/--no-profile).
    auto_profile: bool = False
    # Replay decode-only steps from CUDA graphs (decode_graphs.py), and other steps of up to
    # 512 tokens from piecewise graphs, attention eager between them (mixed_graphs.py). None:
    # on where they can run (CUDA, one process; decodes need the Triton attention backend,
    # the pieces a model without experts); True asks for them (still eager on a CPU, where
    # the same static paths run without capture); False: eager steps.
    cuda_graphs: bool | None = None
    # Decode steps of one or two rows from inductor-compiled static programs on a CPU
    # (decode_graphs.py, compile_cpu). None: on where the weights are served quantized and the
    # model can run them (one process, no sliding window or soft-capping, no experts); True
    # asks for them (an error where they cannot run or compile); False: eager decodes.
    cpu_compile: bool | None = None
    # The batch sizes those programs are compiled for (increasing; up to --max-num-seqs):
    # a batch runs padded in the next size up, a larger one eagerly.
    cpu_compile_sizes: tuple[int, ...] = (1, 2)
    # Run batches made only of fresh short prefills through the padded static-shape path,
    # replaying one CUDA graph per bucket on CUDA (eagerly on CPU). Single process only.
    short_prefill_graphs: bool = False
    short_prefill_buckets: ShortPrefillBuckets = field(default_factory=ShortPrefillBuckets)
    # Prefill/decode disaggregation: the role and the KV transfer (engine/roles/).
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    # Host-memory and disk tiers under the device KV pool (kv_tier_store.py).
    kv_tiers: KVTierSettings = field(default_factory=KVTierSettings)
    # The scheduler's settings, the one owner of max_num_seqs (which also caps the KV cache
    # and sizes the decode graphs) and max_batched_tokens. It travels with the engine config
    # to the parallel workers, as vLLM's runner reads its scheduler config.
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype}")
        if self.cpu_matmul not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_matmul must be auto, onednn or torch, got {self.cpu_matmul}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.quantization not in ("auto", "none", "int8", "int4", "fp8"):
            raise ValueError("quantization must be auto, none, int8, int4 or fp8, got "
                             f"{self.quantization}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError("quantization_group_size must be 32, 64 or 128, got "
                             f"{self.quantization_group_size}")
        gguf_blocks = self.quantization == "auto" and self.gguf_file is not None
        quantized = self.quantization in ("int8", "int4", "fp8") or gguf_blocks
        if self.gguf_activations not in ("bf16", "q8"):
            raise ValueError(f"gguf_activations must be bf16 or q8, got {self.gguf_activations}")
        if self.gguf_activations == "q8" and not (self.gguf_file is not None
                                                  and self.quantization == "auto"):
            raise ValueError("gguf_activations q8 applies to a GGUF file served in its own "
                             "blocks (gguf_file with quantization auto)")
        if quantized and self.parallel.tp > 1:
            raise ValueError(f"--tp {self.parallel.tp}: quantized weights run without tensor "
                             "parallelism for now (--tp 1, or --quantization none)")
        if quantized and self.parallel.ep > 1:
            raise ValueError(f"--ep {self.parallel.ep}: quantized weights (a GGUF's blocks) run "
                             "without expert parallelism for now (--ep 1, or --quantization "
                             "none)")
        if gguf_blocks and not self.parallel.is_single_process:
            raise ValueError("a GGUF's own blocks are served by a single process for now: "
                             "--spp/--kvp workers read safetensors (add --quantization none "
                             "to convert the file to float first)")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy, got {self.load_format}")
        if self.short_prefill_graphs and not self.parallel.is_single_process:
            raise ValueError("short_prefill_graphs (the bucketed short-prefill path) runs in a "
                             "single process only; it is not wired into tp/spp/kvp workers yet")
        sizes = self.cpu_compile_sizes
        if not sizes or min(sizes) < 1 or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"cpu_compile_sizes: positive integers, strictly increasing, "
                             f"got {list(sizes)}")
        if self.cpu_compile and self.cuda_graphs:
            raise ValueError("cpu_compile and cuda_graphs are two ways to run decode steps; "
                             "ask for one")
        if self.cpu_compile and not self.parallel.is_single_process:
            raise ValueError("cpu_compile (compiled CPU decode steps) runs in a single process "
                             "only; it is not wired into tp/spp/kvp workers yet")
        if self.cuda_graphs and not self.parallel.is_single_process:
            raise ValueError("cuda_graphs (decode steps from CUDA graphs) runs in a single "
                             "process only; it is not wired into tp/spp/kvp workers yet")
        if self.kv_tiers.enabled and not self.parallel.is_single_process:
            raise ValueError("KV tiers (--kv-host-memory) run in a single process only; they "
                             "are not wired into tp/spp/kvp workers yet")
        if self.kv_tiers.enabled and self.disagg.enabled:
            raise ValueError(f"KV tiers (--kv-host-memory) are not supported with --role "
                             f"{self.disagg.role} yet")
        if self.disagg.enabled and not self.parallel.is_single_process:
            raise ValueError(f"--role {self.disagg.role} runs in a single process only; KV "
                             "transfer is not wired into tp/spp/kvp workers yet")

    @property
    def serves_quantized_weights(self) -> bool:
        """Whether the weights are served quantized by request: a GGUF in its own blocks, or
        ``--quantization int8/int4/fp8`` (a quantized checkpoint with ``auto`` is not known
        before loading)."""
        return self.quantization in ("int8", "int4", "fp8") or (
            self.quantization == "auto" and self.gguf_file is not None)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.name

