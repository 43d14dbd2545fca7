"""Scheduling policies: which prefill goes first, and which running request yields memory.

    Scheduler --> policy.prefill_key() --> PrefillQueue (priority_index.py) --> packer order
    Scheduler (KV pressure) --> policy.victim_key() --> preemption victim (largest key)

A policy never touches queues or blocks; it maps a request to numbers.

Keeping ``schedule()`` cheap with 10,000 waiting requests. Every policy here has a sort key
that only changes when the request itself changes state (a chunk computed, a preemption), so
requests are sorted once on entry and re-sorted only on those events:

- FCFS ``a``; EDF ``a + d``; Justitia the virtual finish time ``F``; SRPT the predicted
  remaining time (fixed while waiting).
- LRS: slack ``a + d - now - remaining``. ``now`` is common to all requests, so the order is
  that of ``K = a + d - remaining``, which is time-invariant.
- LARS (Slipstream's, ``lars``): the lane (short if ``w_total <= short_lane_work_s``), then
  the deadline plus the work left, ``a + d + remaining``, which changes only when a chunk is
  computed. Its reserve for the oldest late long request is a heap by arrival, pruned lazily.
- LARS as Medha published it (``lars-classic``): relative slack ``(K - now) / w_total``. Two
  requests with equal ``w_total`` keep their order forever (it is the order of ``K``); with
  different ``w_total`` the lines in ``now`` cross. So requests are bucketed into length
  classes of nearly equal ``w_total`` (classes 2% wide in ``w_total``), sorted by ``K`` inside
  a class, and only the class heads are scored at ``now`` and merged by a heap. The order inside a class uses the class's representative
  work, so it can differ from exact LARS only between requests whose ``w_total`` is within 2%.
  The cost per iteration is one score per non-empty class plus a heap pop per candidate.

SRPT follows TRAIL: requests are ordered by predicted remaining time, and a running request
may be displaced by a shorter waiting one only during its first ``floor(c * r)`` decode
iterations (``r`` its first predicted output length, ``c = 0.8``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar

from slipstream.agent.scheduler.length_predictor import LengthPredictor
from slipstream.agent.scheduler.request import Request
from slipstream.agent.scheduler.urgency import MIN_PREFILL_WORK_S, UrgencyModel


@dataclass
class PolicyContext:
    """What a policy may consult."""

    urgency: UrgencyModel
    length_predictor: LengthPredictor
    kv_capacity_tokens: int
    decode_step_s: float  # time of one decode iteration, the target batch time
    srpt_preemptible_fraction: float = 0.8
    short_lane_work_s: float = 0.5  # LARS: the most prefill work a short-lane request has
    late_reserve_fraction: float = 0.5  # LARS: batch share kept for a late long prefill
    reserve_grace: float = 2.0  # LARS: ... once late by this many of its own TTFT deadlines


class SchedulingPolicy:
    name: ClassVar[str] = "base"
    running_first: ClassVar[bool] = False  # offer running prefills before any waiting request
    head_of_line_blocking: ClassVar[bool] = False  # a waiting request that does not fit stops admission
    can_displace: ClassVar[bool] = False  # may a waiting request evict a running one

    def __init__(self, context: PolicyContext) -> None:
        self.context = context
        self.urgency_model = context.urgency

    # Per-bucket scales when the order changes with time: score = (key - now) * scale[bucket].
    # None means the key alone is the order (see priority_index.py).
    score_scale: Mapping[Any, float] | None = None

    def prefill_key(self, request: Request, now_s: float) -> tuple[Hashable, float]:
        raise NotImplementedError

    def urgency(self, request: Request, now_s: float) -> float:
        """The request's place in the prefill order at ``now``: smaller is more urgent."""
        bucket, key = self.prefill_key(request, now_s)
        return key if self.score_scale is None else (key - now_s) * self.score_scale[bucket]

    def space_share_slack(self, request: Request, now_s: float) -> float:
        """The relative slack the packer uses to size a long prefill's share of the batch."""
        return self.urgency_model.relative_slack(request, now_s)

    def reserved_request(self, now_s: float, eligible: Callable[[Request], bool]
                         ) -> tuple[Request, float] | None:
        """A request to keep a share of this batch for, and the share; ``eligible`` says
        whether a request could get a chunk now. None for most policies."""
        return None

    def victim_key(self, request: Request, now_s: float) -> Any:
        """Comparable; under KV pressure the running request with the largest key goes first."""
        return self.urgency(request, now_s)

    def on_add(self, request: Request, now_s: float) -> None:
        pass

    def on_finish(self, request: Request, now_s: float) -> None:
        pass

    def on_step(self, now_s: float) -> None:
        pass

    def may_displace(self, candidate: Request, victim: Request, now_s: float) -> bool:
        return False


class FcfsPolicy(SchedulingPolicy):
    name = "fcfs"
    head_of_line_blocking = True

    def prefill_key(self, request, now_s):
        return 0, request.arrival_s


class EdfPolicy(SchedulingPolicy):
    name = "edf"

    def prefill_key(self, request, now_s):
        return 0, request.ttft_deadline_s


class LrsPolicy(SchedulingPolicy):
    name = "lrs"

    def prefill_key(self, request, now_s):
        return 0, request.ttft_deadline_s - self.urgency_model.remaining_prefill_s(request)


class LarsClassicPolicy(SchedulingPolicy):
    """Medha's LARS as published: least relative slack first (kept for comparison)."""

    name = "lars-classic"
    class_width = 0.02  # relative width of a w_total class

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self._log_width = math.log1p(self.class_width)
        self._inverse_class_work: dict[int, float] = {}  # filled as classes appear
        self.score_scale = self._inverse_class_work

    def work_class(self, prefill_work_s: float) -> int:
        work_class = int(math.log(max(prefill_work_s, MIN_PREFILL_WORK_S) / MIN_PREFILL_WORK_S)
                         / self._log_width)
        if work_class not in self._inverse_class_work:
            work = MIN_PREFILL_WORK_S * math.exp((work_class + 0.5) * self._log_width)
            self._inverse_class_work[work_class] = 1.0 / work
        return work_class

    def prefill_key(self, request, now_s):
        key = request.ttft_deadline_s - self.urgency_model.remaining_prefill_s(request)
        return self.work_class(request.prefill_work_s), key


# Keys of the long lane are offset by this much, so that every short-lane key (an absolute
# deadline on the scheduler's clock, far below it) sorts first.
LONG_LANE_OFFSET_S = 1e12


class LarsPolicy(SchedulingPolicy):
    """LARS with a short lane; docs/scheduling.md ("LARS with a short lane") explains it.

    - Short lane (bucket 0): requests whose whole prefill (``w_total``) is at most
      ``short_lane_work_s``. They come before every other prefill, so a short request is
      served at once instead of waiting out its slack behind a long prefill.
    - Long lane (bucket 1): the rest, after the short lane (its keys are offset by
      ``LONG_LANE_OFFSET_S``).
    - In each lane the key is the deadline plus the predicted prefill work left: EDF that
      lets a smaller request pass a bigger one due a little earlier, and that keeps a started
      prefill going (its key only falls as chunks complete, where least-slack keys rise and
      make prefills take turns). The key changes only when a chunk is computed, so the order
      needs no re-sorting between iterations.
    - Reserve: the oldest long-lane request, once it is late by more than ``reserve_grace``
      times its own TTFT deadline (``deadline - arrival``), keeps ``late_reserve_fraction`` of
      every batch and the batch's one long-prefill slot. A stream of short requests, or of
      later long ones with earlier deadlines, cannot starve it: its TTFT is at most
      ``(1 + reserve_grace)`` deadlines plus its work at that share. The grace keeps the
      reserve out of ordinary queueing, where it only splits batches (between the short lane
      and a long prefill, or between two long prefills) and makes both sides later.
    """

    name = "lars"

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.short_lane_work_s = context.short_lane_work_s
        self.late_reserve_fraction = context.late_reserve_fraction
        self.reserve_grace = context.reserve_grace
        # Long-lane requests by arrival, pruned lazily: the reserve goes to the oldest.
        self._long_lane: list[tuple[float, int, Request]] = []
        self._in_long_lane: set[Request] = set()
        self._seq = 0

    def in_short_lane(self, request: Request) -> bool:
        assert request.prefill_work_s is not None, "assign() sets it when the request arrives"
        return request.prefill_work_s <= self.short_lane_work_s

    def prefill_key(self, request, now_s):
        assert request.ttft_deadline_s is not None, "assign() sets it when the request arrives"
        key = request.ttft_deadline_s + self.urgency_model.remaining_prefill_s(request)
        if self.in_short_lane(request):
            return 0, key
        if request not in self._in_long_lane:
            self._in_long_lane.add(request)
            self._seq += 1
            heapq.heappush(self._long_lane, (request.arrival_s, self._seq, request))
        return 1, LONG_LANE_OFFSET_S + key

    def space_share_slack(self, request, now_s):
        return 0.0  # short-lane requests are packed first; a long prefill takes what is left

    def reserved_request(self, now_s, eligible):
        lane = self._long_lane
        if self.late_reserve_fraction <= 0.0:
            return None
        while lane:
            request = lane[0][2]
            if request.is_finished or not request.in_prefill:
                heapq.heappop(lane)
                self._in_long_lane.discard(request)
                continue
            if not eligible(request) or not self.starving(request, now_s):
                return None
            return request, self.late_reserve_fraction
        return None

    def starving(self, request: Request, now_s: float) -> bool:
        """Late by more than the grace: even on an empty machine its first token would come
        after ``arrival + (1 + reserve_grace) * (deadline - arrival)``."""
        assert request.ttft_deadline_s is not None, "assign() sets it when the request arrives"
        grace_s = self.reserve_grace * (request.ttft_deadline_s - request.arrival_s)
        return self.urgency_model.slack_s(request, now_s) < -grace_s

    def on_finish(self, request, now_s):
        self._in_long_lane.discard(request)  # its heap entry is pruned when it surfaces


class SrptPolicy(SchedulingPolicy):
    name = "srpt"
    can_displace = True

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self._first_prediction: dict[Request, int] = {}

    def on_add(self, request, now_s):
        if request not in self._first_prediction:
            self._first_prediction[request] = self.context.length_predictor.predict_output_tokens(request)

    def on_finish(self, request, now_s):
        self._first_prediction.pop(request, None)

    def remaining_s(self, request: Request) -> float:
        predicted = self._first_prediction.get(request, request.max_tokens)
        decodes_left = max(1, predicted - request.num_output_tokens)
        return self.urgency_model.remaining_prefill_s(request) + decodes_left * self.context.decode_step_s

    def preemptible(self, request: Request) -> bool:
        predicted = self._first_prediction.get(request, request.max_tokens)
        return request.num_output_tokens < math.floor(self.context.srpt_preemptible_fraction * predicted)

    def prefill_key(self, request, now_s):
        return 0, self.remaining_s(request)

    def victim_key(self, request, now_s):
        return self.preemptible(request), self.remaining_s(request)

    def may_displace(self, candidate, victim, now_s):
        return self.preemptible(victim) and self.remaining_s(victim) > self.remaining_s(candidate)
