"""What the engine reports about itself, as pure data (no torch): the metrics layer and its
tests import this without the model stack.

    LLMEngine.stats() -> EngineStats       (a snapshot; AsyncEngine refreshes it every step)
    LLMEngine.step(): schedule -> execute -> StepStats -> on_step(stats) -> update

``StepStats`` holds engine-clock readings, not durations, so that building one costs nothing
beyond the clock reads the step makes anyway; the observer reads ``batch`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slipstream.agent.scheduler.batch import Batch

if TYPE_CHECKING:
    from slipstream.agent.engine.step.load_window import LoadSnapshot
    from slipstream.agent.scheduler.scheduler import Scheduler


# Prices a prompt backlog before the engine has measured its own prefill rate.
NOMINAL_PREFILL_TOKENS_PER_S = 1000.0


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions_total: int
    kvp_active_degree: int = 1  # KVP groups the widest running request spans
    # Load over the recent window (LoadWindow), for the control API and pool rebalancing.
    backlog_prompt_tokens: int = 0
    utilization: float = 0.0
    prefill_tokens_per_s: float = 0.0
    slo_deviation: float = 0.0
    # Prefix caching (cumulative): prompt tokens looked up at admission and found cached,
    # cached blocks evicted to make room, and blocks holding a reusable prefix now.
    kv_blocks_cached: int = 0
    prefix_cache_lookup_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_evictions: int = 0
    # For the autoscaler: SLO attainment counts over the window, and the prompt tokens
    # arriving per second (over the prefill rate: the prefill load).
    first_tokens: int = 0
    ttft_met: int = 0
    finished: int = 0
    tpot_met: int = 0
    arrival_prompt_tokens_per_s: float = 0.0
    # Disaggregation (cumulative; zero in the mixed role): KV hand-offs by outcome, and the
    # prompt blocks a decode instance transferred or found in its own prefix cache.
    kv_transfers_acknowledged: int = 0
    kv_transfers_expired: int = 0
    kv_transfers_completed: int = 0
    kv_transfers_failed: int = 0
    kv_transfer_blocks: int = 0
    kv_transfer_cached_blocks: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_overlapped_blocks: int = 0  # read while their prefill was still running
    # KV tiers (cumulative except the occupancy; zero without tiers): prompt tokens loaded
    # from the host and the disk tier at first admission, blocks each tier holds and can
    # hold, bytes moved each way, seconds spent loading onto the device and reading disk
    # blocks, and blocks a failing tier dropped (a corrupt disk block, a failed write).
    prefix_cache_hit_tokens_host: int = 0
    prefix_cache_hit_tokens_disk: int = 0
    kv_host_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    kv_disk_blocks_used: int = 0
    kv_disk_blocks_total: int = 0
    kv_tier_bytes_offloaded: int = 0  # device -> host
    kv_tier_bytes_loaded: int = 0  # host -> device
    kv_tier_bytes_spilled: int = 0  # host -> disk
    kv_tier_bytes_fetched: int = 0  # disk -> host
    kv_tier_load_seconds: float = 0.0
    kv_tier_fetch_seconds: float = 0.0
    kv_tier_failed_blocks: int = 0

    @staticmethod
    def of(scheduler: Scheduler, load: LoadSnapshot, kvp_active_degree: int,
           transfers: dict[str, float]) -> EngineStats:
        """``LLMEngine.stats()``: its scheduler's queues and KV cache, the load window's
        snapshot, and the counters of the KV transfers (a prefill or decode role) and the
        KV tiers' store (the runner's)."""
        backlog = sum(r.num_uncached_tokens for r in scheduler.requests.values()
                      if r.in_prefill)
        manager = scheduler.block_manager
        tiers = manager.tiers
        if tiers is not None:
            transfers = {**transfers,
                         "prefix_cache_hit_tokens_host": manager.prefix_hit_tokens_host,
                         "prefix_cache_hit_tokens_disk": manager.prefix_hit_tokens_disk,
                         "kv_host_blocks_used": tiers.host_blocks_used,
                         "kv_host_blocks_total": tiers.config.host_blocks,
                         "kv_disk_blocks_used": tiers.disk_blocks_used,
                         "kv_disk_blocks_total": tiers.config.disk_blocks,
                         "kv_tier_failed_blocks": tiers.failed_blocks}
        return EngineStats(
            num_waiting=scheduler.num_waiting, num_running=scheduler.num_running,
            kv_blocks_used=manager.kv_blocks_used, kv_blocks_total=manager.kv_blocks_total,
            kv_blocks_cached=manager.kv_blocks_cached,
            prefix_cache_lookup_tokens=manager.prefix_lookup_tokens,
            prefix_cache_hit_tokens=manager.prefix_hit_tokens,
            prefix_cache_evictions=manager.prefix_evictions,
            num_preemptions_total=scheduler.num_preemptions_total,
            kvp_active_degree=kvp_active_degree,
            backlog_prompt_tokens=backlog, utilization=load.utilization,
            prefill_tokens_per_s=load.prefill_tokens_per_s, slo_deviation=load.slo_deviation,
            first_tokens=load.first_tokens, ttft_met=load.ttft_met, finished=load.finished,
            tpot_met=load.tpot_met,
            arrival_prompt_tokens_per_s=load.arrival_prompt_tokens_per_s,
            **transfers)  # type: ignore[arg-type]  # each counter has its field's type

    @property
    def queue_backlog_s(self) -> float:
        """Seconds to prefill the backlog at the recent prefill rate."""
        rate = self.prefill_tokens_per_s or NOMINAL_PREFILL_TOKENS_PER_S
        return self.backlog_prompt_tokens / rate

    @property
    def prefill_load(self) -> float:
        """Seconds of prefill work arriving per second, at the recent prefill rate."""
        rate = self.prefill_tokens_per_s or NOMINAL_PREFILL_TOKENS_PER_S
        return self.arrival_prompt_tokens_per_s / rate


@dataclass(frozen=True, slots=True)
class StepStats:
    batch: Batch
    schedule_start_s: float  # before Scheduler.schedule()
    execute_start_s: float  # after it, before ModelRunner.execute()
    execute_end_s: float  # after execute() returned the sampled tokens
    forward_s: float  # the model forward inside the execution (ModelRunner.last_forward_s)

    @property
    def schedule_s(self) -> float:
        return self.execute_start_s - self.schedule_start_s

    @property
    def execute_s(self) -> float:
        return self.execute_end_s - self.execute_start_s


@dataclass(frozen=True, slots=True)
class StepSummary:
    """What the step metrics need of a ``StepStats``, small enough to cross from an engine-core
    process to the API process every step (no block tables, no token ids)."""

    prefill_chunk_tokens: tuple[int, ...]
    num_decode_tokens: int
    schedule_s: float
    execute_s: float
    predicted_time_s: float | None

    @staticmethod
    def of(step: StepStats) -> StepSummary:
        prefill: list[int] = []
        decodes = 0
        for chunk in step.batch.chunks:
            if chunk.is_decode:
                decodes += 1
            else:
                prefill.append(len(chunk.token_ids))
        return StepSummary(tuple(prefill), decodes, step.schedule_s, step.execute_s,
                           step.batch.predicted_time_s)
