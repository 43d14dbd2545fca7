"""Adaptive Wait-Depth batching of short prefills (PLA-Serve, Algorithm 1 and section 3.2).

    short-pool instance: Scheduler.add(short request) --> AdaptiveWaitDepth.add (held)
    every iteration / timer: AdaptiveWaitDepth.poll(now) --> ShortPrefillBatch or None
        --> the batch's requests enter the prefill queue together (one graph-shaped batch)
    after it ran: AdaptiveWaitDepth.observe_service(seconds) --> the service estimate S

Why in the scheduler, not the router: AWD forms one *forward batch* whose shape
(padded length L, depth B) matches a captured CUDA graph. Only the instance's scheduler
decides what runs in one iteration; requests that the router held back and released together
would still be split and interleaved by the engine. The router's part is to send short
prompts to the short pool, where this batching pays off (section 3.2: a pool of only short
prefills gives shape-homogeneous batches).

The policy, in our words. Requests wait in length buckets (the captured lengths, powers of
two). A round starts when the first request waits; its batch is the bucket of the most urgent
request, topped up with requests from smaller buckets (they pad up to the same length) while
``depth * L`` fits the token budget. The batch is released as soon as one of these holds:
- it reached the target depth ``D``;
- the round has waited ``W``, where ``W = clip(min(W_fill, W_rate), [W_min, W_max])``:
  ``W_fill`` is learnt from how long batches took to fill, ``W_rate`` is when the round is
  expected to reach ``D`` at the measured arrival rate, counted from its latest arrival (so
  under a steady rate it stays put as requests come in, rather than shrinking with every
  arrival and releasing half-full batches that would then pull ``D`` down);
- some request's slack ``deadline - (now + S)`` is at most ``slack_threshold_s`` (the
  deadline-aware early dispatch; ``S`` is the estimated service time of one prefill step);
- the oldest request has waited ``max_head_wait_s``.
After a release, a batch that reached ``D`` sets ``W_fill`` to its fill time and lets ``D`` grow
to the next captured depth (the paper's listing only ever lowers ``D``; without growth one
quiet spell would pin it low); a batch released by the window lowers ``D`` to its depth.
Requests without a deadline (offline mode) are released by depth, window or head wait only.

Capturing and replaying CUDA graphs per (L, B) shape is the model runner's job and needs a
GPU; ``ShortPrefillBatch.graph_shape`` names the shape to replay, or None for the eager path.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

DEFAULT_GRAPH_LENGTHS = (8, 16, 32, 64, 128, 256)
DEFAULT_GRAPH_DEPTHS = (1, 2, 4, 8, 16, 32, 64)
_TIME_TOLERANCE_S = 1e-9  # clock sums like 25 ms - 5 ms - 10 ms must compare as equal


@dataclass(frozen=True)
class AWDConfig:
    graph_lengths_tokens: tuple[int, ...] = DEFAULT_GRAPH_LENGTHS
    graph_depths: tuple[int, ...] = DEFAULT_GRAPH_DEPTHS
    token_budget: int = 8192  # padded tokens in one batch (the memory budget M)
    min_wait_s: float = 0.0
    max_wait_s: float = 0.020
    max_head_wait_s: float = 0.050
    slack_threshold_s: float = 0.010
    initial_service_s: float = 0.010
    rate_smoothing: float = 0.2  # EWMA weight of the newest inter-arrival gap / service time

    def __post_init__(self) -> None:
        for name in ("graph_lengths_tokens", "graph_depths"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"{name} must be increasing positive integers")
        if self.token_budget < self.graph_lengths_tokens[0]:
            raise ValueError("token_budget must hold at least one request of the smallest length")
        if not 0 <= self.min_wait_s <= self.max_wait_s:
            raise ValueError("need 0 <= min_wait_s <= max_wait_s")
        if self.max_head_wait_s < 0 or self.slack_threshold_s < 0 or self.initial_service_s < 0:
            raise ValueError("max_head_wait_s, slack_threshold_s, initial_service_s must be >= 0")
        if not 0 < self.rate_smoothing <= 1:
            raise ValueError("rate_smoothing must be in (0, 1]")

    @property
    def max_short_tokens(self) -> int:
        return self.graph_lengths_tokens[-1]


@dataclass(frozen=True)
class PendingPrefill:
    request_id: str
    prompt_tokens: int
    arrival_s: float
    deadline_s: float | None  # absolute TTFT deadline; None in deadline-free (offline) mode


@dataclass(frozen=True)
class ShortPrefillBatch:
    request_ids: tuple[str, ...]
    padded_length_tokens: int  # the bucket length L every member is padded to
    graph_shape: tuple[int, int] | None  # (L, B) of the captured graph to replay, or eager
    reason: str  # depth, window, deadline or head_wait
    fill_time_s: float  # from the round's first arrival to release

    @property
    def depth(self) -> int:
        return len(self.request_ids)


class AdaptiveWaitDepth:
    def __init__(self, config: AWDConfig) -> None:
        self.config = config
        self.service_estimate_s = config.initial_service_s
        self.window_fill_s = config.max_wait_s
        self.target_depth = self._deepest_fitting_depth(config.graph_lengths_tokens[-1])
        self._buckets: dict[int, deque[PendingPrefill]] = {
            length: deque() for length in config.graph_lengths_tokens}
        self._round_started_s: float | None = None
        self._last_arrival_s: float | None = None
        self._mean_gap_s: float | None = None

    # -- inputs -------------------------------------------------------------------------------

    def add(self, request: PendingPrefill) -> None:
        if request.prompt_tokens > self.config.max_short_tokens:
            raise ValueError(f"{request.request_id}: {request.prompt_tokens} tokens is not a "
                             f"short prefill (longest bucket {self.config.max_short_tokens})")
        self._buckets[self.bucket_of(request.prompt_tokens)].append(request)
        if self._round_started_s is None:
            self._round_started_s = request.arrival_s
        if self._last_arrival_s is not None:
            gap = max(0.0, request.arrival_s - self._last_arrival_s)
            self._mean_gap_s = gap if self._mean_gap_s is None else self._smooth(
                self._mean_gap_s, gap)
        self._last_arrival_s = request.arrival_s

    def remove(self, request_id: str) -> bool:
        """Forget a waiting request (aborted or finished elsewhere); False if it is not here."""
        for length, bucket in self._buckets.items():
            if any(r.request_id == request_id for r in bucket):
                self._buckets[length] = deque(r for r in bucket if r.request_id != request_id)
                if not self.num_waiting():
                    self._round_started_s = None  # nothing left: the next arrival opens a round
                return True
        return False

    def observe_service(self, seconds: float) -> None:
        """The measured time of a released batch's prefill step (updates ``S``)."""
        self.service_estimate_s = self._smooth(self.service_estimate_s, max(0.0, seconds))

    # -- decisions ----------------------------------------------------------------------------

    def poll(self, now_s: float) -> ShortPrefillBatch | None:
        """Release a batch if one is due at ``now_s``."""
        members, length = self._candidate_batch()
        if not members:
            return None
        reason = self._release_reason(members, now_s)
        if reason is None:
            return None
        return self._release(members, length, reason, now_s)

    def next_poll_s(self, now_s: float) -> float | None:
        """The latest time ``poll`` must run again (no arrivals in between), or None."""
        members, _ = self._candidate_batch()
        if not members:
            return None
        times = [self.window_end_s(len(members)),
                 min(m.arrival_s for m in members) + self.config.max_head_wait_s]
        times += [m.deadline_s - self.service_estimate_s - self.config.slack_threshold_s
                  for m in members if m.deadline_s is not None]
        return max(now_s, min(times))

    def window_end_s(self, depth: int) -> float:
        """When this round's waiting window ``W`` closes, for a batch of ``depth`` so far."""
        start, last_arrival_s = self._round_started_s, self._last_arrival_s
        assert start is not None and last_arrival_s is not None, "no round without requests"
        end = start + self.window_fill_s
        if self._mean_gap_s is not None and self._mean_gap_s > 0:
            # Leftovers of a release open a round after their own arrivals.
            latest = max(start, last_arrival_s)
            end = min(end, latest + max(0, self.target_depth - depth) * self._mean_gap_s)
        return min(max(end, start + self.config.min_wait_s), start + self.config.max_wait_s)

    def bucket_of(self, prompt_tokens: int) -> int:
        lengths = self.config.graph_lengths_tokens
        return lengths[bisect.bisect_left(lengths, max(1, prompt_tokens))]

    def num_waiting(self) -> int:
        return sum(len(bucket) for bucket in self._buckets.values())

    # -- internals ----------------------------------------------------------------------------

    def _candidate_batch(self) -> tuple[list[PendingPrefill], int]:
        """The most urgent request's bucket, topped up from smaller buckets within budget."""
        heads = [bucket[0] for bucket in self._buckets.values() if bucket]
        if not heads:
            return [], 0
        urgent = min(heads, key=_urgency)
        length = self.bucket_of(urgent.prompt_tokens)
        max_depth = min(self._deepest_fitting_depth(length), self.target_depth)
        members: list[PendingPrefill] = []
        for bucket_length in sorted((bl for bl in self._buckets if bl <= length), reverse=True):
            for request in sorted(self._buckets[bucket_length], key=_urgency):
                if len(members) == max_depth:
                    return members, length
                members.append(request)
        return members, length

    def _release_reason(self, members: list[PendingPrefill], now_s: float) -> str | None:
        config = self.config
        slack = [m.deadline_s - (now_s + self.service_estimate_s) for m in members
                 if m.deadline_s is not None]
        if slack and min(slack) <= config.slack_threshold_s + _TIME_TOLERANCE_S:
            return "deadline"
        if len(members) >= self.target_depth:
            return "depth"
        if now_s - min(m.arrival_s for m in members) >= config.max_head_wait_s - _TIME_TOLERANCE_S:
            return "head_wait"
        if now_s >= self.window_end_s(len(members)) - _TIME_TOLERANCE_S:
            return "window"
        return None

    def _release(self, members: list[PendingPrefill], length: int, reason: str,
                 now_s: float) -> ShortPrefillBatch:
        released = {id(member) for member in members}
        for bucket_length, bucket in self._buckets.items():
            if any(id(request) in released for request in bucket):
                self._buckets[bucket_length] = deque(r for r in bucket if id(r) not in released)
        assert self._round_started_s is not None, "members were waiting, so a round is open"
        fill_time_s = now_s - self._round_started_s
        depth = len(members)
        if depth >= self.target_depth:
            self.window_fill_s = min(max(fill_time_s, self.config.min_wait_s),
                                     self.config.max_wait_s)
            self.target_depth = self._next_depth(depth, length)
        elif reason == "window":
            self.target_depth = max(1, depth)
        # Requests left behind (other buckets, or past the depth) open the next round now.
        self._round_started_s = now_s if self.num_waiting() else None
        depths = self.config.graph_depths
        graph_depth = next((d for d in depths if d >= depth and d * length
                            <= self.config.token_budget), None)
        return ShortPrefillBatch(
            request_ids=tuple(m.request_id for m in members), padded_length_tokens=length,
            graph_shape=None if graph_depth is None else (length, graph_depth),
            reason=reason, fill_time_s=fill_time_s)

    def _deepest_fitting_depth(self, length: int) -> int:
        fitting = [d for d in self.config.graph_depths if d * length <= self.config.token_budget]
        return fitting[-1] if fitting else 1

    def _next_depth(self, depth: int, length: int) -> int:
        limit = self._deepest_fitting_depth(self.config.graph_lengths_tokens[0])
        larger = [d for d in self.config.graph_depths if d > depth]
        return min(larger[0], limit) if larger else depth

    def _smooth(self, mean: float, sample: float) -> float:
        weight = self.config.rate_smoothing
        return (1 - weight) * mean + weight * sample


def _urgency(request: PendingPrefill) -> tuple[float, float]:
    """Earliest deadline first; requests without one after, oldest first."""
    deadline = request.deadline_s if request.deadline_s is not None else float("inf")
    return deadline, request.arrival_s
