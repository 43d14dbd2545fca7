"""Metrics of a serving benchmark, defined exactly as vLLM's ``bench serve`` defines them, so
numbers from ``slipstream bench serve`` and from vLLM's tool can be put side by side.

    RequestTiming per request (send time, token arrival times, usage counts)
        --> serving_metrics() --> {"mean_ttft_ms": ..., "p99_itl_ms": ..., "request_goodput": ...}

Per request (successful ones only):
- TTFT: first content chunk - send time.
- E2EL: last chunk - send time.
- TPOT: ``(e2el - ttft) / (output_tokens - 1)``, for requests with more than one output token.
- ITL: the gaps between successive content chunks (a chunk may carry several tokens).
Over the run, ``duration_s`` being the benchmark's wall time:
- request throughput = completed / duration; output throughput = output tokens / duration;
  total token throughput = (input + output tokens) / duration.
- goodput = requests meeting every given SLO (``ttft``, ``tpot``, ``e2el`` in ms) / duration.
Each latency gets mean, median, std and the requested percentiles (default p99), in ms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestTiming:
    send_s: float
    prompt_tokens: int = 0  # from the server's usage when it reports one
    output_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    success: bool = False
    error: str = ""
    scheduled_s: float = 0.0  # when the arrival process wanted it sent

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.send_s if self.chunk_times_s else None

    @property
    def e2el_s(self) -> float | None:
        return self.chunk_times_s[-1] - self.send_s if self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        times = self.chunk_times_s
        if self.output_tokens < 2 or not times:
            return None
        return (times[-1] - times[0]) / (self.output_tokens - 1)  # E2E latency minus TTFT

    @property
    def itls_s(self) -> list[float]:
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"goodput SLO {item!r}: expected KEY:MS with KEY in {GOODPUT_KEYS}")
        slos[key] = float(value)
        if slos[key] <= 0:
            raise ValueError(f"goodput SLO {item!r} must be > 0 ms")
    return slos


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(values_ms.mean()),
           f"median_{name}_ms": float(np.median(values_ms)),
           f"std_{name}_ms": float(values_ms.std())}
    for p in percentiles:
        label = f"{p:g}".replace(".", "_")
        out[f"p{label}_{name}_ms"] = float(np.percentile(values_ms, p))
    return out


def meets_goodput(timing: RequestTiming, slos: dict[str, float]) -> bool:
    values = {"ttft": timing.ttft_s, "tpot": timing.tpot_s or 0.0, "e2el": timing.e2el_s}
    return all((value := values[key]) is not None and value * 1000.0 <= limit
               for key, limit in slos.items())


def serving_metrics(timings: list[RequestTiming], duration_s: float,
                    goodput_slos: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = (99.0,)) -> dict:
    ok = [t for t in timings if t.success]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    itls = [gap for t in ok for gap in t.itls_s]
    e2els = [t.e2el_s for t in ok if t.e2el_s is not None]
    input_tokens = sum(t.prompt_tokens for t in ok)
    output_tokens = sum(t.output_tokens for t in ok)
    duration_s = max(duration_s, 1e-9)
    metrics: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    if goodput_slos:
        good = sum(1 for t in ok if meets_goodput(t, goodput_slos))
        metrics["request_goodput"] = good / duration_s
        metrics["goodput_slos_ms"] = dict(goodput_slos)
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats(name, values, percentiles))
    return metrics
