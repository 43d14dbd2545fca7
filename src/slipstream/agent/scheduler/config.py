"""Scheduler configuration: one frozen, validated object, built once and passed explicitly.

The CRD's ``spec.scheduler`` (policy, targetBatchTimeMs, maxSpaceShareFraction,
longRequestThresholdTokens, preemption, prefixCaching, shortPrefillBatching,
shortPrefillMaxWaitMs) maps onto these fields one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slipstream.agent.scheduler.awd import AWDConfig
from slipstream.agent.scheduler.packer import PackerConfig
from slipstream.agent.scheduler.predictor import BatchTimeModel, model_floor_target_ms

POLICY_NAMES = ("fcfs", "edf", "lrs", "lars", "lars-classic", "srpt", "justitia")
PREEMPTION_MODES = ("recompute", "swap")
SHORT_PREFILL_BATCHING_MODES = ("off", "awd")
AWD_SHORTEST_BUCKET_TOKENS = 8  # PLA-Serve's smallest captured prompt length


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at once
    # Without a runtime predictor the time budget becomes this token budget per iteration.
    max_batched_tokens: int = 512
    policy: str = "lars"
    target_batch_time_ms: float = 50.0  # t_target; should come from the TPOT SLO
    # Nobody chose the target (no --target-batch-time-ms, no TPOT SLO): with a predictor,
    # raise it to model_floor_target_ms where the model is too slow for it (engine.py).
    raise_target_to_model_floor: bool = False
    max_space_share_fraction: float = 0.5
    long_request_threshold_tokens: int = 262_144
    preemption: str = "recompute"
    # Reuse the KV of prompt prefixes computed before (content-addressed blocks, block_manager.py).
    prefix_caching: bool = True
    kvp_tokens_per_group: int | None = None
    spp_degree: int = 1
    min_ttft_deadline_s: float = 0.5
    ttft_deadline_factor: float = 1.5
    max_prefill_candidates: int = 64  # prefills examined per iteration that got no chunk
    srpt_preemptible_fraction: float = 0.8  # TRAIL's c
    max_displacements_per_step: int = 1
    # LARS (policies.py): a request with at most this much prefill work is in the short lane,
    # served before any other prefill; the oldest long prefill, once it is late by more than
    # lars_reserve_grace times its own TTFT deadline (deadline - arrival), keeps
    # lars_late_reserve_fraction of every batch.
    lars_short_lane_ms: float = 500.0
    lars_late_reserve_fraction: float = 0.5
    lars_reserve_grace: float = 2.0
    # While another application is active (requests in the scheduler, or one arrived or left
    # within shared_step_window_s), a prefill longer than this fraction of the target whose
    # slack covers the slower pace yields: packed last, beside no other application's
    # prefill, adding at most this fraction to a batch (shared_steps.py); 1 turns it off.
    shared_step_fraction: float = 0.25
    shared_step_window_s: float = 1.0
    # Blocks kept free when admitting new requests, as a fraction of the device pool, so
    # running decodes can grow without an immediate preemption.
    admission_watermark_fraction: float = 0.01
    # PLA-Serve's Adaptive Wait-Depth batching of short prefills (short_batching.py). "awd"
    # holds each new prompt of at most awd_max_prompt_tokens (and below the long threshold)
    # until enough of them arrive to fill a batch, the window passes or a deadline is near.
    short_prefill_batching: str = "off"
    awd_max_prompt_tokens: int = 256  # the longest length bucket; buckets are 8, 16, ... this
    awd_max_wait_ms: float = 20.0  # W_max: the longest a round waits to fill
    awd_max_head_wait_ms: float = 50.0  # T_max: no request is held longer than this
    awd_slack_threshold_ms: float = 10.0  # sigma: dispatch once a deadline is this close
    awd_token_budget_tokens: int = 8192  # M: padded tokens in one released batch

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.spp_degree < 1:
            raise ValueError("spp_degree must be >= 1")
        if self.max_prefill_candidates < 1:
            raise ValueError("max_prefill_candidates must be >= 1")
        if not 0.0 < self.srpt_preemptible_fraction <= 1.0:
            raise ValueError("srpt_preemptible_fraction must be in (0, 1]")
        if self.lars_short_lane_ms < 0:
            raise ValueError("lars_short_lane_ms must be >= 0")
        if not 0.0 <= self.lars_late_reserve_fraction < 1.0:
            raise ValueError("lars_late_reserve_fraction must be in [0, 1)")
        if self.lars_reserve_grace < 0:
            raise ValueError("lars_reserve_grace must be >= 0")
        if not 0.0 < self.shared_step_fraction <= 1.0:
            raise ValueError("shared_step_fraction must be in (0, 1]")
        if self.shared_step_window_s < 0:
            raise ValueError("shared_step_window_s must be >= 0")
        if self.max_displacements_per_step < 0:
            raise ValueError("max_displacements_per_step must be >= 0")
        if not 0.0 <= self.admission_watermark_fraction < 1.0:
            raise ValueError("admission_watermark_fraction must be in [0, 1)")
        if self.short_prefill_batching not in SHORT_PREFILL_BATCHING_MODES:
            raise ValueError(f"short_prefill_batching must be one of "
                             f"{SHORT_PREFILL_BATCHING_MODES}, got {self.short_prefill_batching!r}")
        max_prompt = self.awd_max_prompt_tokens
        if max_prompt < AWD_SHORTEST_BUCKET_TOKENS or max_prompt & (max_prompt - 1):
            raise ValueError(f"awd_max_prompt_tokens must be a power of two >= "
                             f"{AWD_SHORTEST_BUCKET_TOKENS}, got {max_prompt}")
        if self.awd_max_head_wait_ms < self.awd_max_wait_ms:
            raise ValueError(f"awd_max_head_wait_ms ({self.awd_max_head_wait_ms}) must be at "
                             f"least awd_max_wait_ms ({self.awd_max_wait_ms})")
        self.packer_config()  # validates the packer fields too
        self.awd_config()  # and the AWD ones

    def awd_config(self, token_budget_cap: int | None = None) -> AWDConfig:
        """AWD's settings; ``token_budget_cap`` keeps a released batch within one iteration
        when the iteration is a token budget (no runtime predictor)."""
        lengths = []
        length = AWD_SHORTEST_BUCKET_TOKENS
        while length <= self.awd_max_prompt_tokens:
            lengths.append(length)
            length *= 2
        budget = self.awd_token_budget_tokens
        if token_budget_cap is not None:
            budget = max(AWD_SHORTEST_BUCKET_TOKENS, min(budget, token_budget_cap))
        return AWDConfig(graph_lengths_tokens=tuple(lengths), token_budget=budget,
                         max_wait_s=self.awd_max_wait_ms / 1000.0,
                         max_head_wait_s=self.awd_max_head_wait_ms / 1000.0,
                         slack_threshold_s=self.awd_slack_threshold_ms / 1000.0)

    def packer_config(self) -> PackerConfig:
        return PackerConfig(
            target_batch_time_ms=self.target_batch_time_ms,
            max_space_share_fraction=self.max_space_share_fraction,
            long_request_threshold_tokens=self.long_request_threshold_tokens,
            kvp_tokens_per_group=self.kvp_tokens_per_group,
        )

    def token_budget_packer_config(self) -> PackerConfig:
        """Without a predictor: any chunk size, filled to exactly ``max_batched_tokens``."""
        return replace(
            self.packer_config(),
            chunk_granularity_tokens=1,
            min_chunk_tokens=1,
            initial_chunk_tokens=min(512, self.max_batched_tokens),
            max_chunk_tokens=self.max_batched_tokens,
            full_batch_fraction=1.0,
        )


def fit_target_to_model(config: SchedulerConfig,
                        model: BatchTimeModel) -> tuple[SchedulerConfig, str | None]:
    """``config`` with a batch-time target ``model`` can be packed under, and a warning when
    the target is below the model's floor (``model_floor_target_ms``). A default target
    (``raise_target_to_model_floor``) is raised to the floor; a chosen one is kept."""
    floor_ms = model_floor_target_ms(model)
    target_ms = config.target_batch_time_ms
    if floor_ms <= target_ms:
        return config, None
    if config.raise_target_to_model_floor:
        return replace(config, target_batch_time_ms=floor_ms), (
            f"a 128-token prefill is predicted at {floor_ms / 2:.0f} ms on this device, so the "
            f"default {target_ms:g} ms batch-time target would leave no room for a prefill next "
            f"to a running decode and requests would run one after another; using "
            f"{floor_ms:.0f} ms (--target-batch-time-ms or --slo-tpot-ms sets it)")
    return config, (
        f"the {target_ms:g} ms batch-time target is below what this model needs on this device "
        f"({floor_ms:.0f} ms, twice a 128-token prefill): while a request decodes, new prompts "
        f"get no chunk and wait for the running requests to finish")
