"""Builds an engine with the runner its parallel layout needs.

One process: the engine's own in-process ``ModelRunner``. ``tp x spp x kvp > 1``: a
``ParallelExecutor`` that starts (or waits for) the worker processes. The CLI and the
benchmarks build engines here, so ``agent/engine`` never imports ``agent/parallel``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from slipstream.agent.engine.config import EngineConfig, ModelConfig, check_parallel_fit
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.models.loader import check_checkpoint
from slipstream.agent.engine.parts import with_scheduler
from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.scheduler.scheduler import SchedulerConfig


def build_engine(config: EngineConfig, scheduler_config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 output_text: bool = True) -> LLMEngine:
    config = with_scheduler(config, scheduler_config)  # the workers size their KV by it
    if config.parallel.is_single_process:
        return LLMEngine(config, None, clock, output_text=output_text)
    from slipstream.agent.parallel.executor import ParallelExecutor  # zmq only when needed

    # What every worker would find wrong, found once here, before any of them starts.
    check_parallel_fit(ModelConfig.from_dir(config.model_dir), config.parallel)
    check_checkpoint(config.model_dir)
    Tokenizer.from_dir(config.model_dir)

    executor = ParallelExecutor(config)
    try:
        return LLMEngine(config, None, clock, runner=executor,
                         output_text=output_text)
    except BaseException:
        executor.close()
        raise
