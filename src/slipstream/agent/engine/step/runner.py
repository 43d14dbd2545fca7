"""The seam between the engine loop and whatever runs the model.

    LLMEngine --execute(batch) / submit(batch) + collect()--> Runner
              <--{request_id: SampledToken}------------------

Two runners implement it: the in-process ``ModelRunner`` (``agent/engine/step/model_runner.py``)
and the ``ParallelExecutor`` that drives worker processes (``agent/parallel/executor.py``).
The engine only talks to this protocol; whoever builds the engine (the CLI, a benchmark, a
test) picks the runner, so the engine never imports ``agent/parallel``
(``slipstream.agent.parallel.compose.build_engine`` does it for a parallel config).

- ``execute`` runs one batch and returns its sampled tokens (the plain loop).
- ``submit``/``collect`` keep up to ``pipeline_depth`` batches in flight (SPP); a runner
  without a pipeline has depth 1 and runs the batch inside ``submit``.
- ``masks`` (``execute``, ``submit``): the grammar masks of the batch's rows under a grammar,
  a callable started before the batch runs and called once its logits are ready; the
  parallel executor ships them to the sampler rank (``agent/parallel/executor.py``).
- ``release`` says that requests have left the engine (finished, aborted or failed), so a
  runner that keeps per-request state (the workers' copy of block tables) can drop it.
- ``check_alive`` raises ``EngineDeadError`` when the runner can no longer serve; ``close``
  stops what it started.
- ``last_forward_s`` is the model forward time of the last batch, where the runner can see it
  (0 where it cannot).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from slipstream.agent.engine.kv.tier_settings import KVTierSettings
from slipstream.agent.engine.step.batch_io import SampledToken
from slipstream.agent.engine.sampling.sampler import MaskSource
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.kv_tiers import KVTierConfig, TierResults

Sampled = dict[str, SampledToken]


class Runner(Protocol):
    num_kv_blocks: int
    pipeline_depth: int
    last_forward_s: float

    @property
    def num_in_flight(self) -> int: ...

    def execute(self, batch: Batch, masks: MaskSource | None = None) -> Sampled:
        """``masks``: the grammar masks of the batch's guided rows, where supported."""
        ...

    def submit(self, batch: Batch, masks: MaskSource | None = None) -> int:
        """Send ``batch`` (run it, without a pipeline); ``masks`` as for ``execute``."""
        ...

    def collect(self, block: bool) -> list[tuple[int, Sampled]]: ...

    def release(self, request_ids: Collection[str]) -> None: ...

    def allocate_host_cache(self, num_blocks: int) -> None:
        """Host-memory KV blocks for swap preemption; ValueError where not supported."""
        ...

    def enable_kv_tiers(self, settings: KVTierSettings, host_load_gb_per_s: float = 0.0,
                        disk_read_gb_per_s: float = 0.0) -> KVTierConfig | None:
        """Host and disk KV tiers under the pool (kv_tier_store.py); ValueError where not
        supported, None where the host memory could not be had."""
        ...

    def poll_kv_tiers(self) -> TierResults:
        """Fetches ended and spills failed since the last poll (empty without tiers)."""
        ...

    def kv_tier_counters(self) -> dict[str, float]:
        """Cumulative bytes each way and seconds loading (empty without tiers)."""
        ...

    def check_alive(self) -> None: ...

    def close(self) -> None: ...
