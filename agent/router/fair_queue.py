"""Application-level fair queuing at the router (Justitia, sections IV-A and IV-C).

    dispatcher: every candidate instance saturated --> FairQueue.push(tag(app_id, ...))
    a slot frees --> dispatcher drains FairQueue in ascending virtual finish time

When instances have room, requests go straight through (work-conserving); this queue only
orders who goes next once every candidate is at its concurrency cap. The tag is the
scheduler's: ``F = max(V(a), F_app) + C`` with ``C = p*d + d^2/2`` KV token-time, from
``scheduler/justitia.py`` (the same ``VirtualClock``, the same cost), so a flood from one
application cannot starve another's requests: the newcomer's tag starts at ``V(now)``, below
the flooder's accumulated tags.

Two things differ from the engine's copy, because the router sees no iterations and no
tokens: ``V`` advances by wall time over the engines' iteration time, and ``M`` is the KV
capacity of the instances that serve the class (as their ``/metrics`` report it). The output
length ``d`` is predicted per application from finished requests, capped by ``max_tokens``;
the scheduler's ``RunningMeanLengthPredictor`` wants a scheduler ``Request``, which the router
has no reason to build, so the mean is kept here.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
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
    """Items ordered by Justitia virtual finish time; ties in arrival order."""

    def __init__(self, fairness: FairnessConfig, clock: Callable[[], float]) -> None:
        self._fairness = fairness
        self._now = clock
        self.virtual_clock = VirtualClock(fairness.default_kv_capacity_tokens)
        self.demand = ApplicationDemand(fairness.prior_output_tokens)
        self._last_advance_s = clock()
        self._heap: list[tuple[float, int, T]] = []
        self._sequence = itertools.count()

    def set_capacity_tokens(self, capacity_tokens: int) -> None:
        self._advance()  # time so far ran at the old rate
        self.virtual_clock.capacity_tokens = max(1, capacity_tokens)

    def tag(self, app_id: str, prompt_tokens: int, max_tokens: int | None) -> float:
        """The virtual finish time of a new request (advances the application's tag)."""
        self._advance()
        output_tokens = self.demand.predict_output_tokens(app_id, max_tokens)
        return self.virtual_clock.tag(app_id, kv_token_time(prompt_tokens, output_tokens))

    def _advance(self) -> None:
        now_s = self._now()
        iterations = (now_s - self._last_advance_s) / self._fairness.iteration_s
        self._last_advance_s = now_s
        if iterations > 0:
            self.virtual_clock.advance(iterations)

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
