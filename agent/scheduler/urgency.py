"""Deadlines and slack: the time quantities every policy orders requests by.

    PrefillTimeCache --> UrgencyModel --> policies.py (keys), packer (relative slack of long
    requests), victim choice under KV pressure

At ``Scheduler.add`` each request gets an absolute TTFT deadline ``a + d`` and its total
prefill work ``w_total = T(p)``. ``d`` comes from the request's SLO; without one it is
``max(T(p) * 1.5, 0.5 s)``, as in Medha's reference code. Medha section 4.1 defines

    slack            s   = a + d - now - remaining_prefill
    relative slack   rho = s / w_total

where ``w_total`` is the request's whole prefill work (Medha's "total work requirement"). A
request preempted by recompute has to prefill its generated tokens too, so its ``w_total`` is
refreshed to ``T(num_tokens)``; its deadline stays.
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

    def assign(self, request: Request) -> None:
        """Set ``ttft_deadline_s`` (once) and ``prefill_work_s`` (refreshed on requeue)."""
        work_s = max(self.prefill_times.total_s(request.num_tokens), MIN_PREFILL_WORK_S)
        request.prefill_work_s = max(work_s, request.prefill_work_s or 0.0)
        if request.ttft_deadline_s is None:
            ttft_s = request.slo.ttft_s
            if ttft_s is None:
                ttft_s = max(work_s * self.ttft_deadline_factor, self.min_ttft_deadline_s)
            request.ttft_deadline_s = request.arrival_s + ttft_s

    def remaining_prefill_s(self, request: Request) -> float:
        if request.num_uncomputed_tokens <= 1 and request.num_computed_tokens > 0:
            return 0.0  # decoding
        return self.prefill_times.remaining_s(request.num_tokens, request.num_computed_tokens)

    def slack_s(self, request: Request, now_s: float) -> float:
        return request.ttft_deadline_s - now_s - self.remaining_prefill_s(request)

    def relative_slack(self, request: Request, now_s: float) -> float:
        return self.slack_s(request, now_s) / request.prefill_work_s
