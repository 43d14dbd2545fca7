"""Recent load of one engine, for the control API and the operator's pool rebalancer.

    LLMEngine.step() --record_step--> LoadWindow <--record_first_token-- first output token
                                                 <--record_finish-- a request's last token
                                                 <--record_arrival-- a new request
    LLMEngine.stats() --snapshot(now)--> utilization, prefill rate, SLO deviation, attainment

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
    # SLO attainment counts for the autoscaler (counts, not fractions, so that instances
    # add up): first tokens within their TTFT target, finished requests within their TPOT one.
    # Prompt tokens arriving per second: over the prefill rate, the seconds of prefill work
    # arriving per second, the autoscaler's load signal (it grows with the arrival rate, also
    # past saturation, where every busy fraction stops at 1).
    arrival_prompt_tokens_per_s: float = 0.0
    first_tokens: int = 0
    ttft_met: int = 0
    finished: int = 0
    tpot_met: int = 0


class LoadWindow:
    """Steps and first tokens of the trailing window, with running sums so that a snapshot
    costs O(1) amortized: the engine takes one after every step, and summing a 30 s window
    of a fast engine's steps (thousands) each time cost about a millisecond per step."""

    def __init__(self, start_s: float, window_s: float = DEFAULT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._start_s = start_s
        self._steps: deque[tuple[float, float, int]] = deque()  # (start_s, end_s, prefill tokens)
        self._ttft: deque[tuple[float, float]] = deque()  # (time_s, relative overshoot)
        self._tpot: deque[tuple[float, bool]] = deque()  # (time_s, within its target)
        self._arrivals: deque[tuple[float, int]] = deque()  # (time_s, prompt tokens)
        self._arrived_tokens = 0
        # Sums over the entries in the deques, kept as entries come and go.
        self._busy_s = 0.0
        self._prefill_busy_s = 0.0
        self._prefill_tokens = 0
        self._deviation_sum = 0.0
        self._ttft_met = 0
        self._tpot_met = 0
        # Kept past the window: the last known prefill rate still prices a backlog that
        # arrives after a quiet spell.
        self._last_rate_tokens_per_s = 0.0

    def record_step(self, start_s: float, end_s: float, prefill_tokens: int) -> None:
        self._steps.append((start_s, end_s, prefill_tokens))
        self._add_step(start_s, end_s, prefill_tokens, sign=1)
        self._trim(end_s)

    def record_first_token(self, now_s: float, ttft_s: float, target_s: float) -> None:
        deviation = max(0.0, ttft_s / target_s - 1.0)
        self._ttft.append((now_s, deviation))
        self._deviation_sum += deviation
        self._ttft_met += deviation == 0.0
        self._trim(now_s)

    def record_finish(self, now_s: float, tpot_s: float, target_s: float) -> None:
        """A request with a TPOT target finished; ``tpot_s`` is its mean time per output
        token after the first."""
        met = tpot_s <= target_s
        self._tpot.append((now_s, met))
        self._tpot_met += met
        self._trim(now_s)

    def record_arrival(self, now_s: float, prompt_tokens: int) -> None:
        self._arrivals.append((now_s, prompt_tokens))
        self._arrived_tokens += prompt_tokens
        self._trim(now_s)

    def snapshot(self, now_s: float) -> LoadSnapshot:
        self._trim(now_s)
        window_start = max(now_s - self.window_s, self._start_s)
        span_s = now_s - window_start
        busy_s = self._busy_s
        # Only the oldest steps can straddle the window's start; steps are recorded in
        # (nearly) start order, so the scan stops at the first one inside the window.
        for start, end, _ in self._steps:
            if start >= window_start:
                break
            busy_s -= min(end, window_start) - start
        utilization = min(1.0, max(0.0, busy_s) / span_s) if span_s > 0 else 0.0
        arrival_rate = self._arrived_tokens / span_s if span_s > 0 else 0.0
        if self._prefill_busy_s > 0 and self._prefill_tokens > 0:
            self._last_rate_tokens_per_s = self._prefill_tokens / self._prefill_busy_s
        slo_deviation = self._deviation_sum / len(self._ttft) if self._ttft else 0.0
        return LoadSnapshot(utilization=utilization,
                            prefill_tokens_per_s=self._last_rate_tokens_per_s,
                            slo_deviation=slo_deviation,
                            arrival_prompt_tokens_per_s=arrival_rate,
                            first_tokens=len(self._ttft),
                            ttft_met=self._ttft_met, finished=len(self._tpot),
                            tpot_met=self._tpot_met)

    def _add_step(self, start_s: float, end_s: float, prefill_tokens: int, sign: int) -> None:
        self._busy_s += sign * (end_s - start_s)
        if prefill_tokens:
            self._prefill_busy_s += sign * (end_s - start_s)
            self._prefill_tokens += sign * prefill_tokens

    def _trim(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        steps, ttft = self._steps, self._ttft
        while steps and steps[0][1] < horizon:
            self._add_step(*steps.popleft(), sign=-1)
        while ttft and ttft[0][0] < horizon:
            deviation = ttft.popleft()[1]
            self._deviation_sum -= deviation
            self._ttft_met -= deviation == 0.0
        tpot = self._tpot
        while tpot and tpot[0][0] < horizon:
            self._tpot_met -= tpot.popleft()[1]
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] < horizon:
            self._arrived_tokens -= arrivals.popleft()[1]
        # Running sums drift by rounding; an empty window resets them exactly.
        if not steps:
            self._busy_s = self._prefill_busy_s = 0.0
            self._prefill_tokens = 0
        if not ttft:
            self._deviation_sum = 0.0
            self._ttft_met = 0
