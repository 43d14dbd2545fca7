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
- LARS: relative slack ``(K - now) / w_total``. Two requests with equal ``w_total`` keep their
  order forever (it is the order of ``K``); with different ``w_total`` the lines in ``now``
  cross. So requests are bucketed into length classes of nearly equal ``w_total`` (classes
  2% wide in ``w_total``), sorted by ``K`` inside a class, and only the class heads are scored
  at ``now`` and merged by a heap. The order inside a class uses the class's representative
  work, so it can differ from exact LARS only between requests whose ``w_total`` is within 2%.
  The cost per iteration is one score per non-empty class plus a heap pop per candidate.

SRPT follows TRAIL: requests are ordered by predicted remaining time, and a running request
may be displaced by a shorter waiting one only during its first ``floor(c * r)`` decode
iterations (``r`` its first predicted output length, ``c = 0.8``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Hashable, Mapping
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


class LarsPolicy(SchedulingPolicy):
    name = "lars"
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
