"""The batch packer: one iteration's time budget, filled greedily (Medha Algorithms 1 and 2).

    Scheduler.schedule():
        budget = PrefillBudget(model, config)
        budget.add_decodes(...)                      # phase 1: every running decode
        for request in policy order:                 # phase 2: prefill chunks
            size = budget.chunk_for(kv_before, remaining, relative_slack, fit_tokens)
            if size: budget.add_prefill(kv_before, size)

For each prefill the packer binary-searches the largest chunk (32-token steps, 32 to 8192
tokens, first probe at 512) whose addition keeps the predicted batch time within the target.
Nothing more is packed once the batch is predicted at 90% of the target. Because attention
cost grows with the KV already cached, the same budget yields large chunks early in a prefill
and small ones late: that is adaptive chunking, with no chunk-size schedule of its own.

Space sharing: a long request (KV cached >= ``long_request_threshold_tokens``) may only fill
``target * (1 - clamp(relative_slack, 0, max_space_share_fraction))``, leaving the rest to
short prefills, and at most one long prefill enters a batch. With KV parallelism a chunk is
also capped at the room left in the request's current KVP group. ``chunk_limit_ms`` caps what
one request's chunk may add to the batch (shared_steps.py: a request with slack takes short
steps while another application is active); the requests packed after it keep the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from slipstream.agent.scheduler.predictor import BatchTimeEstimate, BatchTimeModel

# Relative tolerance on the budget, so that n tokens at target/n ms each still fit exactly.
FLOAT_SLACK = 1e-9
# A load from a lower KV tier counts against the budget up to this share of the target when a
# chunk is sized; the batch's predicted time still carries all of it. Without the cap a prefix
# whose load alone exceeds the target (80K tokens of Llama-3-8B over PCIe at 50 ms) would fit
# only an otherwise empty batch, so running decodes would hold it back until they finished.
MAX_LOAD_SHARE_OF_TARGET = 0.5


@dataclass(frozen=True)
class PackerConfig:
    target_batch_time_ms: float = 50.0
    max_space_share_fraction: float = 0.5
    long_request_threshold_tokens: int = 262_144
    chunk_granularity_tokens: int = 32
    min_chunk_tokens: int = 32
    max_chunk_tokens: int = 8192
    initial_chunk_tokens: int = 512
    full_batch_fraction: float = 0.9  # stop packing once the batch is this full
    kvp_tokens_per_group: int | None = None

    def __post_init__(self) -> None:
        if self.target_batch_time_ms <= 0:
            raise ValueError("target_batch_time_ms must be > 0")
        if not 0.0 <= self.max_space_share_fraction < 1.0:
            raise ValueError("max_space_share_fraction must be in [0, 1)")
        if self.long_request_threshold_tokens < 1:
            raise ValueError("long_request_threshold_tokens must be >= 1")
        if self.chunk_granularity_tokens < 1:
            raise ValueError("chunk_granularity_tokens must be >= 1")
        if not 1 <= self.min_chunk_tokens <= self.initial_chunk_tokens <= self.max_chunk_tokens:
            raise ValueError("need 1 <= min_chunk_tokens <= initial_chunk_tokens <= max_chunk_tokens")
        if not 0.0 < self.full_batch_fraction <= 1.0:
            raise ValueError("full_batch_fraction must be in (0, 1]")
        if self.kvp_tokens_per_group is not None and self.kvp_tokens_per_group < 1:
            raise ValueError("kvp_tokens_per_group must be >= 1")


def largest_chunk_tokens(fits: Callable[[int], bool], remaining_tokens: int, cap_tokens: int,
                         config: PackerConfig) -> int:
    """The largest chunk for which ``fits`` holds, or 0; ``fits`` must be monotone.

    The whole remainder is tried first (it need not be a multiple of the granularity), which
    settles short prompts and final chunks with one prediction.
    """
    upper = min(remaining_tokens, cap_tokens, config.max_chunk_tokens)
    if upper <= 0:
        return 0
    if upper == remaining_tokens and fits(upper):
        return upper
    step = config.chunk_granularity_tokens
    low_k = max(1, -(-config.min_chunk_tokens // step))
    high_k = upper // step
    if high_k < low_k:  # less room than one granule: only the room itself can go
        return upper if upper < remaining_tokens and fits(upper) else 0
    probe_k = min(max(config.initial_chunk_tokens // step, low_k), high_k)
    if fits(probe_k * step):
        best, low_k = probe_k, probe_k + 1
    elif probe_k == low_k or not fits(low_k * step):
        return 0  # settles a full batch in two predictions instead of a whole search
    else:
        best, low_k, high_k = low_k, low_k + 1, probe_k - 1
    while low_k <= high_k:
        mid = (low_k + high_k) // 2
        if fits(mid * step):
            best, low_k = mid, mid + 1
        else:
            high_k = mid - 1
    return best * step


class PrefillBudget:
    """The time budget of one batch being packed."""

    def __init__(self, model: BatchTimeModel, config: PackerConfig) -> None:
        self.config = config
        self.estimate = BatchTimeEstimate(model)
        self.has_long_prefill = False
        self.num_prefills = 0
        self._limit_ms = config.target_batch_time_ms  # lowered while a share is reserved
        self._long_slot_reserved = False
        self._full_ms = config.target_batch_time_ms * config.full_batch_fraction
        # The smallest KV length at which a minimum chunk was refused under the full target.
        # Predictions only grow with KV and with the batch, so every request at or above it
        # is refused too, without asking the predictor again.
        self._refused_from_kv = float("inf")

    @property
    def time_ms(self) -> float:
        return self.estimate.time_ms

    @property
    def is_empty(self) -> bool:
        return self.num_prefills == 0 and self.estimate.num_decodes == 0

    @property
    def exhausted(self) -> bool:
        return self.estimate.time_ms >= self._full_ms

    def reserve(self, fraction: float, long_slot: bool) -> None:
        """Keep ``fraction`` of the target free: until ``release_reserve()``, chunks may only
        fill ``target * (1 - fraction)``. With ``long_slot`` the batch's one long prefill is
        kept too, so no other long request takes it."""
        self._set_limit(self.config.target_batch_time_ms * (1.0 - fraction))
        self._long_slot_reserved = long_slot and not self.has_long_prefill
        self.has_long_prefill |= self._long_slot_reserved

    def release_reserve(self) -> None:
        self._set_limit(self.config.target_batch_time_ms)
        if self._long_slot_reserved:
            self.has_long_prefill = self._long_slot_reserved = False

    def _set_limit(self, limit_ms: float) -> None:
        self._limit_ms = limit_ms
        self._full_ms = limit_ms * self.config.full_batch_fraction
        self._refused_from_kv = float("inf")  # refusals were against the old limit

    def add_decodes(self, count: int, kv_total_tokens: int) -> None:
        if count:
            self.estimate.add_decodes(count, kv_total_tokens)

    def is_long(self, kv_before_tokens: int) -> bool:
        return kv_before_tokens >= self.config.long_request_threshold_tokens

    def chunk_for(self, kv_before_tokens: int, remaining_tokens: int, relative_slack: float = 0.0,
                  fit_tokens: int | None = None, load_ms: float = 0.0,
                  chunk_limit_ms: float | None = None) -> int:
        """Algorithm 2: the chunk size for one prefill, or 0 if it cannot go in this batch.

        ``fit_tokens`` caps the chunk at what the free KV blocks can hold. ``load_ms`` is the
        time to load the request's prefix from a lower KV tier first: it takes budget like
        compute does (a lower-tier hit is a load, neither free nor a recompute).
        ``chunk_limit_ms`` is the most the chunk may add to the batch's time; if not even a
        minimum chunk fits under it and the batch holds no prefill yet, the full budget
        applies, so the request never stalls for want of a short enough chunk.
        """
        size = self._budgeted_chunk(kv_before_tokens, remaining_tokens, relative_slack,
                                    fit_tokens, load_ms, chunk_limit_ms)
        if size == 0 and chunk_limit_ms is not None and self.num_prefills == 0:
            size = self._budgeted_chunk(kv_before_tokens, remaining_tokens, relative_slack,
                                        fit_tokens, load_ms)
        if size == 0 and self.is_empty and remaining_tokens > 0:
            return self._over_budget_chunk(kv_before_tokens, remaining_tokens, fit_tokens)
        return size

    def _over_budget_chunk(self, kv_before_tokens: int, remaining_tokens: int,
                           fit_tokens: int | None) -> int:
        """Progress over budget: even a minimum chunk is predicted over the target, and the
        batch would otherwise be empty, which makes no progress at all (a pessimistic
        predictor, or one long prefill deep into its KV, would stall the instance forever).
        Such a step's time is then mostly what does not grow with the chunk (attention over
        a long prefix, a fixed cost), so the chunk may cost up to one more target than the
        minimum chunk: a 64K-token prompt went in 32-token steps before, each paying the
        whole prefix (103 s to the first token on an H200)."""
        cap = remaining_tokens if fit_tokens is None else min(remaining_tokens, fit_tokens)
        minimum = max(0, min(cap, self.config.min_chunk_tokens))
        if minimum == 0:
            return 0
        what_if = self.estimate.time_with_prefill_ms
        limit_ms = (what_if(kv_before_tokens, minimum) + self.config.target_batch_time_ms) * (
            1.0 + FLOAT_SLACK)
        size = largest_chunk_tokens(lambda n: what_if(kv_before_tokens, n) <= limit_ms,
                                    remaining_tokens, cap, self.config)
        return max(minimum, size)

    def _budgeted_chunk(self, kv_before_tokens: int, remaining_tokens: int,
                        relative_slack: float, fit_tokens: int | None,
                        load_ms: float = 0.0, chunk_limit_ms: float | None = None) -> int:
        config = self.config
        if remaining_tokens <= 0 or self.exhausted:
            return 0
        long_request = self.is_long(kv_before_tokens)
        if long_request and self.has_long_prefill:
            return 0
        target_ms = self._limit_ms
        if long_request:
            share = min(config.max_space_share_fraction, max(0.0, relative_slack))
            target_ms *= 1.0 - share
        if chunk_limit_ms is not None:
            target_ms = min(target_ms, self.estimate.time_ms + chunk_limit_ms)
        if self.estimate.time_ms >= target_ms:
            return 0
        cap = remaining_tokens if fit_tokens is None else fit_tokens
        if config.kvp_tokens_per_group is not None:
            group = config.kvp_tokens_per_group
            cap = min(cap, group - kv_before_tokens % group)
        at_least_min_chunk = min(remaining_tokens, cap) >= config.min_chunk_tokens
        if at_least_min_chunk and kv_before_tokens >= self._refused_from_kv:
            return 0
        what_if = self.estimate.time_with_prefill_ms
        limit_ms = target_ms * (1.0 + FLOAT_SLACK)
        charged_ms = min(load_ms, config.target_batch_time_ms * MAX_LOAD_SHARE_OF_TARGET)
        size = largest_chunk_tokens(
            lambda size: what_if(kv_before_tokens, size, charged_ms) <= limit_ms,
            remaining_tokens, cap, config)
        if size == 0 and at_least_min_chunk and not long_request and load_ms == 0.0 \
                and chunk_limit_ms is None:
            self._refused_from_kv = min(self._refused_from_kv, kv_before_tokens)
        return size

    def add_prefill(self, kv_before_tokens: int, chunk_tokens: int, load_ms: float = 0.0) -> None:
        self.estimate.add_prefill(kv_before_tokens, chunk_tokens, load_ms)
        self.num_prefills += 1
        if self.is_long(kv_before_tokens):
            self.has_long_prefill = True
