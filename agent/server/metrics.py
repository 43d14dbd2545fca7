"""Prometheus metrics of one serving instance, scraped from ``GET /metrics``.

    engine RequestOutput stream --(RequestTimer, per request)--> histograms and counters
    engine.stats() --(EngineStatsCollector, at scrape time)--> queue, KV and preemption gauges

Latency histograms carry ``request_class`` (short/long by prompt length) and ``pool`` labels,
so the SLO dashboards can split them the way the pools split traffic. Everything lives in a
private ``CollectorRegistry``: two apps in one process (tests) never share series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.agent.engine.sampling_params import RequestOutput
from slipstream.agent.scheduler.request import RequestSLO

if TYPE_CHECKING:
    from slipstream.agent.engine.engine import EngineStats


def log_spaced_buckets(low_s: float, high_s: float, ratio: float = 2 ** 0.5) -> tuple[float, ...]:
    """Bucket bounds from ``low_s`` growing by ``ratio`` until ``high_s`` is covered."""
    bounds = [low_s]
    while bounds[-1] < high_s:
        bounds.append(bounds[-1] * ratio)
    return tuple(float(f"{bound:.4g}") for bound in bounds)


# Request-level latencies: TTFT SLOs run from ~100 ms (chat) to tens of seconds (1M-token
# prefill). Token-level latencies: TPOT SLOs are tens of ms, a CPU tiny model is ~1 ms.
REQUEST_LATENCY_BUCKETS_S = log_spaced_buckets(0.005, 60.0)
TOKEN_LATENCY_BUCKETS_S = log_spaced_buckets(0.001, 10.0)

_LABELS = ("request_class", "pool")


class ServingMetrics:
    """All metrics of one app. ``stats_source`` is read only when Prometheus scrapes."""

    def __init__(self, stats_source: Callable[[], EngineStats], *, pool: str,
                 long_prompt_threshold_tokens: int) -> None:
        self.pool = pool
        self.long_prompt_threshold_tokens = long_prompt_threshold_tokens
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.ttft_s = Histogram("slipstream_time_to_first_token_seconds",
                                "Arrival to first output token.", _LABELS,
                                buckets=REQUEST_LATENCY_BUCKETS_S, registry=reg)
        self.tpot_s = Histogram("slipstream_time_per_output_token_seconds",
                                "Mean time per output token after the first, per request.",
                                _LABELS, buckets=TOKEN_LATENCY_BUCKETS_S, registry=reg)
        self.itl_s = Histogram("slipstream_inter_token_latency_seconds",
                               "Gap between successive token deliveries to the API layer.",
                               _LABELS, buckets=TOKEN_LATENCY_BUCKETS_S, registry=reg)
        self.e2e_s = Histogram("slipstream_e2e_request_latency_seconds",
                               "Arrival to the last output token.", _LABELS,
                               buckets=REQUEST_LATENCY_BUCKETS_S, registry=reg)
        self.requests = Counter("slipstream_requests", "Finished requests by finish reason.",
                                ("finish_reason",), registry=reg)
        self.prompt_tokens = Counter("slipstream_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", registry=reg)
        self.generation_tokens = Counter("slipstream_generation_tokens",
                                         "Tokens generated and delivered.", registry=reg)
        self.slo_outcomes = Counter("slipstream_slo_requests",
                                    "Finished requests that carried an SLO, by met or missed.",
                                    ("slo", "outcome", "request_class", "pool"), registry=reg)
        reg.register(EngineStatsCollector(stats_source))

    def request_class(self, num_prompt_tokens: int) -> str:
        return "long" if num_prompt_tokens >= self.long_prompt_threshold_tokens else "short"

    def start_request(self, num_prompt_tokens: int, slo: RequestSLO | None) -> RequestTimer:
        return RequestTimer(self, self.request_class(num_prompt_tokens), num_prompt_tokens, slo)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Follows one request's outputs and records its metrics once, when it ends."""

    def __init__(self, metrics: ServingMetrics, request_class: str, num_prompt_tokens: int,
                 slo: RequestSLO | None) -> None:
        self._metrics = metrics
        self._labels = (request_class, metrics.pool)
        self._itl_s = metrics.itl_s.labels(*self._labels)  # bound once: observed per token
        self._num_prompt_tokens = num_prompt_tokens
        self._slo = slo
        self._arrival_s = time.monotonic()
        self._first_token_s: float | None = None
        self._last_token_s: float | None = None
        self._num_output_tokens = 0
        self._recorded = False

    def on_output(self, output: RequestOutput) -> None:
        if not output.new_token_ids:
            return
        now_s = time.monotonic()
        if self._last_token_s is None:
            self._first_token_s = now_s
        else:
            self._itl_s.observe(now_s - self._last_token_s)
        self._last_token_s = now_s
        self._num_output_tokens += len(output.new_token_ids)
        self._metrics.generation_tokens.inc(len(output.new_token_ids))

    def finish(self, final: RequestOutput | None, finish_reason: str) -> None:
        """Record the request's latencies; ``final`` is None when the client went away."""
        if self._recorded:
            return
        self._recorded = True
        metrics = self._metrics
        metrics.requests.labels(finish_reason).inc()
        metrics.prompt_tokens.inc(self._num_prompt_tokens)
        if final is None or finish_reason not in ("stop", "length"):
            return  # aborted and failed requests would skew the latency histograms
        # Prefer the engine's clock (it saw the true arrival); fall back to ours.
        arrival_s = final.arrival_s if final.arrival_s is not None else self._arrival_s
        first_s = final.first_token_s if final.first_token_s is not None else self._first_token_s
        done_s = final.finished_s if final.finished_s is not None else time.monotonic()
        num_output = max(final.num_output_tokens, self._num_output_tokens)
        metrics.e2e_s.labels(*self._labels).observe(done_s - arrival_s)
        if first_s is None:
            return
        ttft_s = first_s - arrival_s
        metrics.ttft_s.labels(*self._labels).observe(ttft_s)
        tpot_s = (done_s - first_s) / (num_output - 1) if num_output > 1 else None
        if tpot_s is not None:
            metrics.tpot_s.labels(*self._labels).observe(tpot_s)
        self._record_slo(ttft_s, tpot_s)

    def _record_slo(self, ttft_s: float, tpot_s: float | None) -> None:
        if self._slo is None:
            return
        counter = self._metrics.slo_outcomes
        if self._slo.ttft_s is not None:
            outcome = "met" if ttft_s <= self._slo.ttft_s else "missed"
            counter.labels("ttft", outcome, *self._labels).inc()
        if self._slo.tpot_s is not None and tpot_s is not None:
            outcome = "met" if tpot_s <= self._slo.tpot_s else "missed"
            counter.labels("tpot", outcome, *self._labels).inc()


class EngineStatsCollector(Collector):
    """Engine gauges, read from ``engine.stats()`` only when scraped: nothing on the hot path."""

    def __init__(self, stats_source: Callable[[], EngineStats]) -> None:
        self._stats_source = stats_source

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unknown until the first scrape; avoids calling the engine at import

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_source()
        queue = GaugeMetricFamily("slipstream_queue_depth", "Requests in the scheduler by "
                                  "state.", labels=["state"])
        queue.add_metric(["waiting"], stats.num_waiting)
        queue.add_metric(["running"], stats.num_running)
        yield queue
        yield GaugeMetricFamily("slipstream_kv_cache_blocks_used", "Paged KV blocks in use.",
                                value=stats.kv_blocks_used)
        yield GaugeMetricFamily("slipstream_kv_cache_blocks_total", "Paged KV blocks in the "
                                "cache.", value=stats.kv_blocks_total)
        yield CounterMetricFamily("slipstream_preemptions", "Requests preempted (recompute or "
                                  "swap) since start.", value=stats.num_preemptions_total)
