"""Recent load of one engine, for the control API and the operator's pool rebalancer.

    LLMEngine.step() --record_step--> LoadWindow <--record_first_token-- first output token
    LLMEngine.stats() --snapshot(now)--> utilization, prefill rate, SLO deviation

Everything is over a trailing window (30 s by default), so the numbers say how the instance
is doing now, not since it started. Pure Python, driven by the engine's clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW_S = 30.0


@dataclass(frozen=True)
class LoadSnapshot:
    utilization: float  # busy fraction of the window, 0..1
    prefill_tokens_per_s: float  # prompt tokens prefilled per busy second (0: no data yet)
    slo_deviation: float  # mean(max(0, ttft / target - 1)) over recent first tokens


class LoadWindow:
    def __init__(self, start_s: float, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._start_s = start_s
        self._steps: deque[tuple[float, float, int]] = deque()  # (start_s, end_s, prefill tokens)
        self._ttft: deque[tuple[float, float]] = deque()  # (time_s, relative overshoot)
        # Kept past the window: the last known prefill rate still prices a backlog that
        # arrives after a quiet spell.
        self._last_rate_tokens_per_s = 0.0

    def record_step(self, start_s: float, end_s: float, prefill_tokens: int) -> None:
        self._steps.append((start_s, end_s, prefill_tokens))
        self._trim(end_s)

    def record_first_token(self, now_s: float, ttft_s: float, target_s: float) -> None:
        self._ttft.append((now_s, max(0.0, ttft_s / target_s - 1.0)))
        self._trim(now_s)

    def snapshot(self, now_s: float) -> LoadSnapshot:
        self._trim(now_s)
        window_start = max(now_s - self.window_s, self._start_s)
        span_s = now_s - window_start
        busy_s = sum(max(0.0, end - max(start, window_start)) for start, end, _ in self._steps)
        utilization = min(1.0, busy_s / span_s) if span_s > 0 else 0.0
        prefill_busy_s = sum(end - start for start, end, tokens in self._steps if tokens)
        prefill_tokens = sum(tokens for _, _, tokens in self._steps)
        if prefill_busy_s > 0 and prefill_tokens > 0:
            self._last_rate_tokens_per_s = prefill_tokens / prefill_busy_s
        deviations = [deviation for _, deviation in self._ttft]
        slo_deviation = sum(deviations) / len(deviations) if deviations else 0.0
        return LoadSnapshot(utilization=utilization,
                            prefill_tokens_per_s=self._last_rate_tokens_per_s,
                            slo_deviation=slo_deviation)

    def _trim(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._steps and self._steps[0][1] < horizon:
            self._steps.popleft()
        while self._ttft and self._ttft[0][0] < horizon:
            self._ttft.popleft()
