"""Application-level fair queuing at the router (Justitia, sections IV-A and IV-C).

    dispatcher: every candidate instance saturated --> FairQueue.push(tag(app_id, ...))
    a slot frees --> dispatcher grants from the FairQueue in ascending virtual finish time

When instances have room, requests go straight through (work-conserving); this queue only
orders who goes next once every candidate is at its concurrency cap. The tag is Justitia's,
``F = max(V, F_app) + C`` with ``C = p*d + d^2/2`` KV token-time, on the scheduler's own
``VirtualClock`` and ``kv_token_time`` (``scheduler/justitia.py``), so a flood from one
application cannot starve another: a newcomer's tag starts at ``V``, below the flooder's
accumulated tags.

What differs is how ``V`` moves. In the engine it follows GPS, advancing ``M / N_t`` per
iteration. The router sees no iterations, and its bottleneck under saturation is the
per-instance concurrency cap, not the KV capacity ``M``; a GPS clock driven by wall time runs
far ahead of the real service and would hand every newcomer a tag behind the whole backlog.
So the router's clock is self-clocked (SCFQ, Golestani 1994): ``V`` is the tag of the request
dispatched last (``VirtualClock.advance_to``). Under saturation, two backlogged applications
then alternate by cost, whatever the service rate. The output length ``d`` is predicted per
application from finished requests and capped by ``max_tokens``; the scheduler's
``RunningMeanLengthPredictor`` wants a scheduler ``Request``, which the router does not build,
so the mean is kept here.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

from slipstream.agent.router.config import FairnessConfig
from slipstream.agent.scheduler.justitia import VirtualClock, kv_token_time

T = TypeVar("T")


class ApplicationDemand:
    """Mean output tokens of each application's finished requests, with a prior."""

    def __init__(self, prior_output_tokens: int) -> None:
        self.prior_output_tokens = prior_output_tokens
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def predict_output_tokens(self, app_id: str, max_tokens: int | None) -> float:
        total = self._sums.get(app_id, 0.0) + self.prior_output_tokens
        guess = total / (self._counts.get(app_id, 0) + 1)
        return guess if max_tokens is None else min(float(max_tokens), guess)

    def observe(self, app_id: str, output_tokens: int) -> None:
        self._sums[app_id] = self._sums.get(app_id, 0.0) + output_tokens
        self._counts[app_id] = self._counts.get(app_id, 0) + 1


class FairQueue(Generic[T]):
    """Items ordered by virtual finish time; ties in arrival order."""

    def __init__(self, fairness: FairnessConfig) -> None:
        self.virtual_clock = VirtualClock(capacity_tokens=1)  # M is unused when self-clocked
        self.demand = ApplicationDemand(fairness.prior_output_tokens)
        self._heap: list[tuple[float, int, T]] = []
        self._sequence = itertools.count()

    def tag(self, app_id: str, prompt_tokens: int, max_tokens: int | None,
            weight: float = 1.0) -> float:
        """The virtual finish time of a new request (advances the application's last tag);
        a tenant of weight ``w`` advances its tags ``1/w`` as fast."""
        output_tokens = self.demand.predict_output_tokens(app_id, max_tokens)
        return self.virtual_clock.tag(app_id, kv_token_time(prompt_tokens, output_tokens),
                                      weight)

    def dispatched(self, finish_tag: float) -> None:
        """A request with this tag went to an instance: virtual time catches up to it."""
        self.virtual_clock.advance_to(finish_tag)

    def push(self, finish_tag: float, item: T) -> None:
        heapq.heappush(self._heap, (finish_tag, next(self._sequence), item))

    def pop(self) -> T:
        return heapq.heappop(self._heap)[2]

    def peek(self) -> T:
        return self._heap[0][2]

    def remove(self, item: T) -> bool:
        for index, entry in enumerate(self._heap):
            if entry[2] is item:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)
