"""Prometheus metrics of the router, served on its ``GET /metrics``.

    proxy: outcome, retries, TTFT as the client sees it        -> counters, histograms
    dispatcher: fair-queue wait                                -> histogram
    scrape: InstanceTable and queue depths read at that moment -> gauges

Names, labels and help texts come from ``metric_names.ROUTER_METRICS``, the registry that the
dashboards are checked against. A private ``CollectorRegistry`` per router keeps tests apart.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest)

from slipstream.agent.router.config import POOLS, REQUEST_CLASSES
from slipstream.agent.router.instances import InstanceTable
from slipstream.contracts import metric_names as names
from slipstream.agent.server.step_metrics import log_spaced_buckets

LATENCY_BUCKETS_S = log_spaced_buckets(0.005, 60.0)
# No ``*_created`` series, as on the agents: no dashboard reads them.
disable_created_metrics()
OUTCOMES = ("ok", "error", "rejected", "cancelled")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(names.ROUTER_REQUESTS.constructor_name, names.ROUTER_REQUESTS.help,
                                names.ROUTER_REQUESTS.labels, registry=reg)
        self.retries = Counter(names.ROUTER_RETRIES.constructor_name, names.ROUTER_RETRIES.help,
                               names.ROUTER_RETRIES.labels, registry=reg)
        self.ttft_s = Histogram(names.ROUTER_TTFT.name, names.ROUTER_TTFT.help,
                                names.ROUTER_TTFT.labels, buckets=LATENCY_BUCKETS_S, registry=reg)
        self.queue_wait_s = Histogram(names.ROUTER_QUEUE_WAIT.name, names.ROUTER_QUEUE_WAIT.help,
                                      names.ROUTER_QUEUE_WAIT.labels, buckets=LATENCY_BUCKETS_S,
                                      registry=reg)
        self.tenant_requests = Counter(names.ROUTER_TENANT_REQUESTS.constructor_name,
                                       names.ROUTER_TENANT_REQUESTS.help,
                                       names.ROUTER_TENANT_REQUESTS.labels, registry=reg)
        self._queue_depth = self._gauge(names.ROUTER_QUEUE_DEPTH)
        self._in_flight = self._gauge(names.ROUTER_IN_FLIGHT)
        self._pool_instances = self._gauge(names.ROUTER_POOL_INSTANCES)
        self._backlog_tokens = self._gauge(names.ROUTER_BACKLOG_TOKENS)
        # Children up front, so every series exists (as 0) from the first scrape.
        for request_class in REQUEST_CLASSES:
            self.queue_wait_s.labels(request_class)
            self._queue_depth.labels(request_class)
            for pool in POOLS:
                self.ttft_s.labels(request_class, pool)
                for outcome in OUTCOMES:
                    self.requests.labels(request_class, pool, outcome)
        for pool in POOLS:
            self.retries.labels(pool)

    def create_tenant_series(self, labels: list[str]) -> None:
        for label in labels:
            self.tenant_requests.labels(label, "ok")

    def count_tenant_request(self, tenant_label: str, outcome: str) -> None:
        self.tenant_requests.labels(tenant_label, outcome).inc()

    def _gauge(self, spec: names.MetricSpec) -> Gauge:
        return Gauge(spec.name, spec.help, spec.labels, registry=self.registry)

    def exposition(self, table: InstanceTable, queue_depth: Callable[[str], int],
                   decode_weight_tokens: float) -> bytes:
        for request_class in REQUEST_CLASSES:
            self._queue_depth.labels(request_class).set(queue_depth(request_class))
        in_flight = dict.fromkeys(POOLS, 0)
        backlog = dict.fromkeys(POOLS, 0.0)
        for instance in table:
            pool = instance.pool
            mean_prompt = table.mean_prompt_tokens(pool if pool in REQUEST_CLASSES
                                                   else REQUEST_CLASSES[0])
            in_flight[pool] = in_flight.get(pool, 0) + instance.own_in_flight
            backlog[pool] = backlog.get(pool, 0.0) + instance.predicted_backlog_tokens(
                decode_weight_tokens, mean_prompt)
        for pool, size in table.pool_sizes().items():
            self._pool_instances.labels(pool).set(size)
            self._in_flight.labels(pool).set(in_flight.get(pool, 0))
            self._backlog_tokens.labels(pool).set(backlog.get(pool, 0.0))
        return generate_latest(self.registry)
