"""Prometheus metrics of one serving instance, scraped from ``GET /metrics``.

    engine RequestOutput stream --(RequestTimer, per request)--> latency histograms, counters,
                                                                 in-flight gauges by class
    engine step --(LLMEngine.on_step -> StepMetrics, step_metrics.py)--> batch histograms
    engine.stats() --(EngineStatsCollector, at scrape time)--> queue, KV and preemption gauges

Latency histograms carry ``request_class`` (short/long by prompt length) and ``pool`` labels,
so the SLO dashboards can split them the way the pools split traffic. Names and help texts come
from ``metric_names``, the registry the dashboards and alert rules are checked against.
Everything lives in a private ``CollectorRegistry``: two apps in one process (tests) never
share series.

Several API processes (``slipstream serve --api-processes N``) share one engine core, and a
scrape reaches whichever process the kernel hands the connection to. There
``$PROMETHEUS_MULTIPROC_DIR`` is set (by the first process, before any metric exists) and
the request-level series (latency histograms, request/token/SLO counters, the in-flight
gauge, summed) are merged from every process's files by prometheus_client's
``MultiProcessCollector``. The engine-level series (batch histograms, queue and KV gauges)
and the constants come from the answering process alone: every API process is sent the same
step summaries and stats, so each holds the same values.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest, values)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats
from slipstream.contracts.request import RequestSLO
from slipstream.contracts import metric_names as names
from slipstream.agent.server.step_metrics import StepMetrics, log_spaced_buckets

# Request-level latencies: TTFT SLOs run from ~100 ms (chat) to tens of seconds (1M-token
# prefill). Token-level latencies: TPOT SLOs are tens of ms, a CPU tiny model is ~1 ms.
REQUEST_LATENCY_BUCKETS_S = log_spaced_buckets(0.005, 60.0)
TOKEN_LATENCY_BUCKETS_S = log_spaced_buckets(0.001, 10.0)
DEFAULT_ATTAINMENT_TARGET = 0.99

# ``*_created`` timestamps would add a series per counter and histogram child that no
# dashboard reads; Prometheus 2 stores them as separate, untyped series.
disable_created_metrics()


def merge_across_processes(directory: str) -> None:
    """Record request metrics in files under ``directory`` that every API process reads at
    a scrape (prometheus_client's multiprocess mode). Call before any metric exists; the
    processes this one starts afterwards inherit it through the environment."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.get_value_class()


def with_bound(buckets: tuple[float, ...], bound_s: float | None) -> tuple[float, ...]:
    """``buckets`` plus the SLO threshold itself, so ``le="<slo>"`` counts attainment exactly."""
    return buckets if bound_s is None else tuple(sorted({*buckets, float(bound_s)}))


def _histogram(spec: names.MetricSpec, buckets: tuple[float, ...],
               registry: CollectorRegistry) -> Histogram:
    return Histogram(spec.name, spec.help, spec.labels, buckets=buckets, registry=registry)


def _counter(spec: names.MetricSpec, registry: CollectorRegistry) -> Counter:
    return Counter(spec.constructor_name, spec.help, spec.labels, registry=registry)


def _summed_gauge(spec: names.MetricSpec, registry: CollectorRegistry) -> Gauge:
    # Summed over the live API processes when there are several (ignored with one).
    return Gauge(spec.name, spec.help, spec.labels, registry=registry,
                 multiprocess_mode="livesum")


class ServingMetrics:
    """All metrics of one app. ``stats_source`` is read only when Prometheus scrapes;
    ``step_metrics.observe`` is meant for ``LLMEngine.on_step``."""

    def __init__(self, stats_source: Callable[[], EngineStats], *, pool: str,
                 long_prompt_threshold_tokens: int, default_slo: RequestSLO | None = None,
                 attainment_target: float = DEFAULT_ATTAINMENT_TARGET) -> None:
        self.pool = pool
        self.long_prompt_threshold_tokens = long_prompt_threshold_tokens
        self.default_slo = default_slo or RequestSLO()
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.ttft_s = _histogram(names.TTFT, with_bound(REQUEST_LATENCY_BUCKETS_S,
                                                        self.default_slo.ttft_s), reg)
        self.tpot_s = _histogram(names.TPOT, with_bound(TOKEN_LATENCY_BUCKETS_S,
                                                        self.default_slo.tpot_s), reg)
        self.itl_s = _histogram(names.ITL, TOKEN_LATENCY_BUCKETS_S, reg)
        self.e2e_s = _histogram(names.E2E, REQUEST_LATENCY_BUCKETS_S, reg)
        self.requests = _counter(names.REQUESTS, reg)
        self.prompt_tokens = _counter(names.PROMPT_TOKENS, reg)
        self.generation_tokens = _counter(names.GENERATION_TOKENS, reg)
        self.slo_outcomes = _counter(names.SLO_REQUESTS, reg)
        self.in_flight = _summed_gauge(names.REQUESTS_IN_FLIGHT, reg)
        self.tenant_requests = _counter(names.TENANT_REQUESTS, reg)
        self.tenant_slo_clamped = _counter(names.TENANT_SLO_CLAMPED, reg)
        self._create_children()
        self.step_metrics = StepMetrics()
        local: list[Collector] = [InstanceCollector(self, attainment_target), self.step_metrics,
                                  EngineStatsCollector(stats_source)]
        for collector in local:
            reg.register(collector)
        # Several API processes: what a scrape of this one shows (see the module docstring).
        self._exported = reg
        if multiprocess_dir := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._exported = CollectorRegistry(auto_describe=True)
            MultiProcessCollector(self._exported, path=multiprocess_dir)
            for collector in local:
                self._exported.register(collector)

    def create_tenant_series(self, labels: list[str]) -> None:
        """Every tenant's series as zeros from the start, so dashboards have data at once."""
        for label in labels:
            self.tenant_requests.labels(label, "ok")
            self.tenant_slo_clamped.labels(label)

    def count_tenant_request(self, tenant_label: str, outcome: str) -> None:
        self.tenant_requests.labels(tenant_label, outcome).inc()

    def count_slo_clamped(self, tenant_label: str) -> None:
        self.tenant_slo_clamped.labels(tenant_label).inc()

    def _create_children(self) -> None:
        """Export every label combination from the start (as zeros), so rates and ratios in
        dashboards and alerts exist before the first request of a kind arrives."""
        for request_class in ("short", "long"):
            labels = (request_class, self.pool)
            for histogram in (self.ttft_s, self.tpot_s, self.itl_s, self.e2e_s):
                histogram.labels(*labels)
            for phase in ("prefill", "decode"):
                self.in_flight.labels(*labels, phase)
            for slo in ("ttft", "tpot", "all"):
                for outcome in ("met", "missed"):
                    self.slo_outcomes.labels(slo, outcome, *labels)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)

    def set_pool(self, pool: str) -> None:
        """Serve another prefill pool from now on (the operator moved this instance): new
        requests carry the new label, and the pool-role gauge says so."""
        if pool == self.pool:
            return
        self.pool = pool
        self._create_children()

    def request_class(self, num_prompt_tokens: int) -> str:
        return "long" if num_prompt_tokens >= self.long_prompt_threshold_tokens else "short"

    def effective_slo(self, slo: RequestSLO | None) -> RequestSLO | None:
        """The request's objectives, each missing one filled from the instance default."""
        default = self.default_slo
        ttft_s = slo.ttft_s if slo is not None and slo.ttft_s is not None else default.ttft_s
        tpot_s = slo.tpot_s if slo is not None and slo.tpot_s is not None else default.tpot_s
        if ttft_s is None and tpot_s is None:
            return None
        return RequestSLO(ttft_s=ttft_s, tpot_s=tpot_s)

    def start_request(self, num_prompt_tokens: int, slo: RequestSLO | None) -> RequestTimer:
        return RequestTimer(self, self.request_class(num_prompt_tokens), num_prompt_tokens,
                            self.effective_slo(slo))

    def exposition(self) -> bytes:
        return generate_latest(self._exported)


class RequestTimer:
    """Follows one request's outputs and records its metrics once, when it ends."""

    def __init__(self, metrics: ServingMetrics, request_class: str, num_prompt_tokens: int,
                 slo: RequestSLO | None) -> None:
        self._metrics = metrics
        self._labels = (request_class, metrics.pool)
        self._itl_s = metrics.itl_s.labels(*self._labels)  # bound once: observed per token
        self._in_prefill = metrics.in_flight.labels(*self._labels, "prefill")
        self._in_decode = metrics.in_flight.labels(*self._labels, "decode")
        self._in_prefill.inc()
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
            if not self._recorded:
                self._in_prefill.dec()
                self._in_decode.inc()
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
        (self._in_prefill if self._last_token_s is None else self._in_decode).dec()
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
        all_met = True
        if self._slo.ttft_s is not None:
            met = ttft_s <= self._slo.ttft_s
            all_met &= met
            counter.labels("ttft", "met" if met else "missed", *self._labels).inc()
        if self._slo.tpot_s is not None and tpot_s is not None:
            met = tpot_s <= self._slo.tpot_s
            all_met &= met
            counter.labels("tpot", "met" if met else "missed", *self._labels).inc()
        # Goodput counts requests that met every objective they had.
        counter.labels("all", "met" if all_met else "missed", *self._labels).inc()


class InstanceCollector(Collector):
    """The instance's constants: its pool (``slipstream_pool_role_info``, 1 for the pool it
    serves now) and its SLO targets."""

    def __init__(self, metrics: ServingMetrics, attainment_target: float) -> None:
        self._metrics = metrics
        self._attainment_target = attainment_target

    def collect(self) -> Iterator[Metric]:
        role = GaugeMetricFamily(names.POOL_ROLE.name, names.POOL_ROLE.help,
                                 labels=names.POOL_ROLE.labels)
        role.add_metric([self._metrics.pool], 1)
        yield role
        yield GaugeMetricFamily(names.SLO_ATTAINMENT_TARGET.name,
                                names.SLO_ATTAINMENT_TARGET.help, value=self._attainment_target)
        slo = self._metrics.default_slo
        for spec, value in ((names.SLO_TTFT_TARGET, slo.ttft_s),
                            (names.SLO_TPOT_TARGET, slo.tpot_s)):
            if value is not None:
                yield GaugeMetricFamily(spec.name, spec.help, value=value)


class EngineStatsCollector(Collector):
    """Engine gauges, read from ``engine.stats()`` only when scraped: nothing on the hot path."""

    def __init__(self, stats_source: Callable[[], EngineStats]) -> None:
        self._stats_source = stats_source

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unknown until the first scrape; avoids calling the engine at import

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_source()
        queue = GaugeMetricFamily(names.QUEUE_DEPTH.name, names.QUEUE_DEPTH.help,
                                  labels=names.QUEUE_DEPTH.labels)
        queue.add_metric(["waiting"], stats.num_waiting)
        queue.add_metric(["running"], stats.num_running)
        yield queue
        for spec, value in ((names.KV_BLOCKS_USED, stats.kv_blocks_used),
                            (names.KV_BLOCKS_CAPACITY, stats.kv_blocks_total),
                            (names.KVP_ACTIVE_DEGREE, stats.kvp_active_degree),
                            (names.KV_BLOCKS_CACHED, stats.kv_blocks_cached)):
            yield GaugeMetricFamily(spec.name, spec.help, value=value)
        for spec, value in ((names.PREEMPTIONS, stats.num_preemptions_total),
                            (names.PREFIX_CACHE_QUERIES, stats.prefix_cache_lookup_tokens),
                            (names.PREFIX_CACHE_HITS, stats.prefix_cache_hit_tokens),
                            (names.PREFIX_CACHE_EVICTIONS, stats.prefix_cache_evictions),
                            (names.KV_TRANSFER_BYTES, stats.kv_transfer_bytes),
                            (names.KV_TRANSFER_OVERLAPPED_BLOCKS,
                             stats.kv_transfer_overlapped_blocks)):
            yield CounterMetricFamily(spec.constructor_name, spec.help, value=value)
        transfers = CounterMetricFamily(names.KV_TRANSFERS.constructor_name,
                                        names.KV_TRANSFERS.help, labels=names.KV_TRANSFERS.labels)
        for outcome in names.KV_TRANSFER_OUTCOMES:
            transfers.add_metric([outcome], getattr(stats, f"kv_transfers_{outcome}"))
        yield transfers
        blocks = CounterMetricFamily(names.KV_TRANSFER_BLOCKS.constructor_name,
                                     names.KV_TRANSFER_BLOCKS.help,
                                     labels=names.KV_TRANSFER_BLOCKS.labels)
        blocks.add_metric(["transferred"], stats.kv_transfer_blocks)
        blocks.add_metric(["prefix_cache"], stats.kv_transfer_cached_blocks)
        yield blocks
        yield from _kv_tier_metrics(stats)


def _kv_tier_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Hits per tier, bytes each way, load time, occupancy and failures of the KV tiers."""
    def counter(spec: names.MetricSpec, values: dict[str, float]) -> Metric:
        family = CounterMetricFamily(spec.constructor_name, spec.help, labels=spec.labels)
        for label, value in values.items():
            family.add_metric([label], value)
        return family

    def gauge(spec: names.MetricSpec, values: dict[str, float]) -> Metric:
        family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
        for label, value in values.items():
            family.add_metric([label], value)
        return family

    lower = stats.prefix_cache_hit_tokens_host + stats.prefix_cache_hit_tokens_disk
    yield counter(names.KV_TIER_HITS, {"device": stats.prefix_cache_hit_tokens - lower,
                                       "host": stats.prefix_cache_hit_tokens_host,
                                       "disk": stats.prefix_cache_hit_tokens_disk})
    yield counter(names.KV_TIER_BYTES, {"device_to_host": stats.kv_tier_bytes_offloaded,
                                        "host_to_device": stats.kv_tier_bytes_loaded,
                                        "host_to_disk": stats.kv_tier_bytes_spilled,
                                        "disk_to_host": stats.kv_tier_bytes_fetched})
    yield counter(names.KV_TIER_LOAD_SECONDS, {"host": stats.kv_tier_load_seconds,
                                               "disk": stats.kv_tier_fetch_seconds})
    yield gauge(names.KV_TIER_BLOCKS_USED, {"host": stats.kv_host_blocks_used,
                                            "disk": stats.kv_disk_blocks_used})
    yield gauge(names.KV_TIER_BLOCKS_CAPACITY, {"host": stats.kv_host_blocks_total,
                                                "disk": stats.kv_disk_blocks_total})
    failed = names.KV_TIER_FAILED_BLOCKS
    yield CounterMetricFamily(failed.constructor_name, failed.help,
                              value=stats.kv_tier_failed_blocks)
