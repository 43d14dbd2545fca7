"""What ``LLMEngine`` is built from, chosen from its config before anything is allocated.

``max_model_len`` caps the context at what the model and the parallel layout support,
``make_runner`` builds the in-process runner (``parallel.compose.build_engine`` passes a
parallel executor instead), and ``scheduler_config`` / ``fit_packer`` fill in what the
scheduler takes from the engine config and fit the packer's time budget to a runtime profile.
"""

from __future__ import annotations

import dataclasses
import logging

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.step.runner import Runner
from slipstream.agent.scheduler.config import SchedulerConfig, fit_target_to_model
from slipstream.agent.scheduler.kv_tiers import KVTierConfig
from slipstream.agent.scheduler.predictor import RuntimePredictor

log = logging.getLogger(__name__)


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context length: ``config.max_model_len`` if the model and the layout allow it
    (ValueError if not), else the most they allow."""
    # Sliding windows (Mistral, Gemma's local layers) are masked by the attention backends,
    # so they do not bound the context.
    limit = model_config.max_position_embeddings
    parallel = config.parallel
    if parallel.kvp > 1:
        limit = min(limit, parallel.max_context_tokens)  # no KVP group beyond the last
    requested = config.max_model_len
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds what the model supports ({limit})")
    return requested or limit


def make_runner(config: EngineConfig, model_config: ModelConfig) -> Runner:
    """The in-process runner; a parallel config needs its runner passed in."""
    if not config.parallel.is_single_process:
        raise ValueError(
            f"tp x spp x kvp = {config.parallel.world_size} needs worker processes: build the "
            "engine with slipstream.agent.parallel.compose.build_engine")
    return ModelRunner(config, model_config)


def with_scheduler(config: EngineConfig, scheduler_config: SchedulerConfig | None
                   ) -> EngineConfig:
    """``config`` with ``scheduler_config`` as its scheduler section, when one is given apart
    (``LLMEngine(config, scheduler_config)``), so the runner and the scheduler read the same
    ``max_num_seqs``."""
    if scheduler_config is None or scheduler_config == config.scheduler:
        return config
    return dataclasses.replace(config, scheduler=scheduler_config)


def scheduler_config(config: EngineConfig) -> SchedulerConfig:
    """The engine config's scheduler section, with the KVP group size of a KVP layout filled
    in."""
    scheduler_config = config.scheduler
    if config.parallel.kvp > 1 and scheduler_config.kvp_tokens_per_group is None:
        scheduler_config = dataclasses.replace(
            scheduler_config, kvp_tokens_per_group=config.parallel.kvp_tokens_per_group)
    return scheduler_config


def fit_packer(config: EngineConfig, scheduler_config: SchedulerConfig
               ) -> tuple[SchedulerConfig, RuntimePredictor | None]:
    """With a runtime profile (``config.profile_dir``): its predictor, and the scheduler
    config with the packer's time budget fitted to it (a warning logged where it had to
    change); without one, the config as it is and no predictor."""
    if config.profile_dir is None:
        return scheduler_config, None
    predictor = RuntimePredictor.from_directory(config.profile_dir)
    scheduler_config, warning = fit_target_to_model(scheduler_config, predictor)
    if warning:
        log.warning("packer: %s", warning)
    return scheduler_config, predictor


def enable_kv_tiers(runner: Runner, config: EngineConfig,
                    predictor: RuntimePredictor | None) -> KVTierConfig | None:
    """The runner's host and disk tiers, priced at the bandwidths the runtime profile
    measured (else the runner measures them as it starts)."""
    meta = predictor.meta if predictor is not None else None
    return runner.enable_kv_tiers(
        config.kv_tiers,
        host_load_gb_per_s=meta.host_load_gb_per_s if meta is not None else 0.0,
        disk_read_gb_per_s=meta.disk_read_gb_per_s if meta is not None else 0.0)
