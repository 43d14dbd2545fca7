"""Justitia: application-level fair queuing by virtual finish time (Justitia IV-A, IV-C).

    Scheduler.add --> JustitiaPolicy.on_add (tag F) --> PrefillQueue order (smallest F first)
    Scheduler.schedule --> on_step (advance the virtual clock V by one iteration)

Cost is memory-centric: a request with prompt ``p`` that generates ``d`` tokens occupies
``p*d + d^2/2`` KV token-iterations. ``d`` is not known at arrival, so the application's demand
is estimated from its finished requests (the length predictor, per ``app_id``).

The reference system is GPS over applications: every active application gets an equal share
``M / N_t`` of the KV capacity ``M`` (tokens). Virtual time ``V`` advances at that rate, per
iteration (Justitia ignores differences in iteration time). Requests arrive one at a time
here, so each application is a flow in the fair-queuing sense: a request's tag is
``F = max(V(a), F_app) + C`` with ``C`` its predicted KV token-time, and ``F_app`` becomes
``F``. An application stays active in GPS until ``V`` reaches its last tag; the clock walks
those departures in order, so advancing it costs O(log N) per departure.

With tenants (docs/tenancy.md) an application is a tenant and has a weight ``w``: weighted
GPS gives it ``w / sum(w)`` of ``M``, so its tags grow by ``C / w``.

Requests run in ascending ``F``, and running requests are never displaced by waiting ones
(non-preemptive between applications); only KV exhaustion preempts, largest ``F`` first. A
mouse stream from any number of applications cannot hold an elephant back forever: ``V``
keeps rising, so new mice eventually carry tags above the elephant's.
"""

from __future__ import annotations

import heapq

from slipstream.agent.scheduler.policies import PolicyContext, SchedulingPolicy
from slipstream.agent.scheduler.request import Request


def kv_token_time(prompt_tokens: int, output_tokens: float) -> float:
    """KV token-iterations a request occupies: ``sum_{i=1..d} (p + i) ~ p*d + d^2/2``."""
    return prompt_tokens * output_tokens + output_tokens * output_tokens / 2.0


class VirtualClock:
    """GPS virtual time over applications."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 1:
            raise ValueError("capacity_tokens must be >= 1")
        self.capacity_tokens = capacity_tokens
        self.now = 0.0
        self._last_tag: dict[str, float] = {}  # active applications -> their last finish tag
        self._weights: dict[str, float] = {}  # active applications -> their share weight
        self._departures: list[tuple[float, str]] = []  # may hold stale entries

    @property
    def num_active(self) -> int:
        return len(self._last_tag)

    def tag(self, app_id: str, cost: float, weight: float = 1.0) -> float:
        """A new request's finish tag. Weighted GPS: an application of weight ``w`` is served
        ``w`` times as fast as one of weight 1, so its cost counts ``1/w`` in virtual time
        (the rate below divides by the active weights' sum)."""
        if not weight > 0:
            raise ValueError("weight must be positive")
        finish = max(self.now, self._last_tag.get(app_id, self.now)) + cost / weight
        self._last_tag[app_id] = finish
        self._weights[app_id] = weight
        heapq.heappush(self._departures, (finish, app_id))
        return finish

    def advance(self, iterations: float = 1.0) -> None:
        left = iterations
        while left > 0 and self._last_tag:
            finish, app = self._departures[0]
            if self._last_tag.get(app) != finish:
                heapq.heappop(self._departures)  # superseded by a later tag
                continue
            rate = self.capacity_tokens / sum(self._weights[app] for app in self._last_tag)
            needed = (finish - self.now) / rate
            if needed > left:
                self.now += rate * left
                return
            self.now = finish
            left -= needed
            heapq.heappop(self._departures)
            del self._last_tag[app]
            self._weights.pop(app, None)


    def advance_to(self, virtual_time: float) -> None:
        """Self-clocked mode (SCFQ): jump ``V`` to ``virtual_time`` (the tag of the request
        just dispatched), retiring the applications whose last tag it passes. For callers
        that see dispatches but no iterations, such as the router."""
        self.now = max(self.now, virtual_time)
        while self._departures and self._departures[0][0] <= self.now:
            finish, app = heapq.heappop(self._departures)
            if self._last_tag.get(app) == finish:
                del self._last_tag[app]
                self._weights.pop(app, None)


class JustitiaPolicy(SchedulingPolicy):
    name = "justitia"
    running_first = True

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.clock = VirtualClock(context.kv_capacity_tokens)
        self._finish_tag: dict[Request, float] = {}

    def on_add(self, request, now_s):
        if request in self._finish_tag:
            return  # a requeued request keeps its place
        output_tokens = self.context.length_predictor.predict_output_tokens(request)
        cost = kv_token_time(request.prompt_len, output_tokens)
        self._finish_tag[request] = self.clock.tag(request.app_id, cost, request.share_weight)

    def on_finish(self, request, now_s):
        self._finish_tag.pop(request, None)

    def on_step(self, now_s):
        self.clock.advance(1.0)

    def finish_tag(self, request: Request) -> float:
        return self._finish_tag[request]

    def prefill_key(self, request, now_s):
        return 0, self._finish_tag[request]
