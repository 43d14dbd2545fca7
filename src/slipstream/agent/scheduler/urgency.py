"""Deadlines and slack: the time quantities every policy orders requests by.

    PrefillTimeCache --> UrgencyModel --> policies.py (keys), packer (relative slack of long
    requests), victim choice under KV pressure

At ``Scheduler.add`` each request gets an absolute TTFT deadline ``a + d`` and its total
prefill work ``w_total = T(p)``. ``d`` comes from the request's SLO; without one it is
``max(T(p) * 1.5, 0.5 s)``, as in Medha's reference code. Medha section 4.1 defines

    slack            s   = a + d - now - remaining_prefill
    relative slack   rho = s / w_total

where ``w_total`` is the request's whole prefill work (Medha's "total work requirement").

A preemption never changes a request's urgency. Once a request has its first token its TTFT
is settled and its remaining prefill counts as zero, even while it recomputes; before that,
it is credited with the progress it had reached.

With prefix caching, a prompt's cached prefix (``Request.prefix_hit_tokens``, looked up at
``add`` and again at admission) counts as processed: a follow-up question over a cached long
document has the work, deadline and slack of the short request it is. A prefix held in a
lower KV tier (host memory, disk) counts as processed too, plus the time to load it
(``Request.prefix_load_s``, bytes over the tier's measured bandwidth). This matters for progress: if recompute made
a request look more urgent (more remaining work, less slack), two requests could evict each
other forever. With it, the most urgent running request is never a victim and finishes.
"""

from __future__ import annotations

from slipstream.agent.scheduler.prefill_time_cache import PrefillTimeCache
from slipstream.agent.scheduler.request import Request

# w_total is never below this, so relative slack stays finite for one-token prompts.
MIN_PREFILL_WORK_S = 1e-4


class UrgencyModel:
    def __init__(self, prefill_times: PrefillTimeCache, min_ttft_deadline_s: float = 0.5,
                 ttft_deadline_factor: float = 1.5) -> None:
        if min_ttft_deadline_s < 0 or ttft_deadline_factor <= 0:
            raise ValueError("min_ttft_deadline_s must be >= 0 and ttft_deadline_factor > 0")
        self.prefill_times = prefill_times
        self.min_ttft_deadline_s = min_ttft_deadline_s
        self.ttft_deadline_factor = ttft_deadline_factor
        self._credited_tokens: dict[Request, int] = {}  # prefill progress lost to recompute

    def note_recompute(self, request: Request, lost_tokens: int) -> None:
        if request.first_token_s is None:
            self._credited_tokens[request] = max(lost_tokens, self._credited_tokens.get(request, 0))

    def forget(self, request: Request) -> None:
        self._credited_tokens.pop(request, None)

    def assign(self, request: Request) -> None:
        """Set ``ttft_deadline_s`` and ``prefill_work_s`` once, at arrival."""
        if request.prefill_work_s is not None:
            return
        # Only the uncached part of the prompt is work; it still attends over the cached
        # prefix, which T(p) - T(cached) prices (the chunks past ``cached`` in T's sequence).
        # A prefix held in a lower KV tier is neither free nor recomputed: it costs its load.
        work_s = max(self.prefill_times.remaining_s(request.num_tokens, request.prefix_hit_tokens)
                     + request.prefix_load_s, MIN_PREFILL_WORK_S)
        request.prefill_work_s = work_s
        if request.ttft_deadline_s is None:
            ttft_s = request.slo.ttft_s
            if ttft_s is None:
                ttft_s = max(work_s * self.ttft_deadline_factor, self.min_ttft_deadline_s)
            request.ttft_deadline_s = request.arrival_s + ttft_s

    def remaining_prefill_s(self, request: Request) -> float:
        if request.first_token_s is not None or (
                request.num_uncomputed_tokens <= 1 and request.num_computed_tokens > 0):
            return 0.0  # TTFT settled, or decoding
        processed = max(request.num_computed_tokens, request.prefix_hit_tokens)
        if self._credited_tokens:
            processed = max(processed, self._credited_tokens.get(request, 0))
        load_s = (request.prefix_load_s if request.num_computed_tokens < request.prefix_hit_tokens
                  else 0.0)
        return self.prefill_times.remaining_s(request.num_tokens, processed) + load_s

    def slack_s(self, request: Request, now_s: float) -> float:
        assert request.ttft_deadline_s is not None, "assign() sets it when the request arrives"
        return request.ttft_deadline_s - now_s - self.remaining_prefill_s(request)

    def relative_slack(self, request: Request, now_s: float) -> float:
        assert request.prefill_work_s is not None, "assign() sets it when the request arrives"
        return self.slack_s(request, now_s) / request.prefill_work_s
