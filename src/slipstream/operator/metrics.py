"""The operator's own Prometheus metrics (``slipstream_operator_*``), served on --metrics-port.

    handle_reconcile / handle_rebalance / handle_autoscale --> these counters and gauges
        --> /metrics

Names, types and labels come from ``contracts/metric_names.py``, the one list that the
dashboards and alert rules are checked against. Per-replica series carry
``replica="<namespace>/<name>"``: a ``namespace`` label would clash with the one Prometheus
attaches to the operator's own pod. One process runs one operator, so the default registry
is fine here (unlike the agent, whose tests run several apps in one process).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from slipstream.contracts import metric_names as names

RECONCILE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _counter(spec: names.MetricSpec) -> Counter:
    return Counter(spec.constructor_name, spec.help, spec.labels)


def _gauge(spec: names.MetricSpec) -> Gauge:
    return Gauge(spec.constructor_name, spec.help, spec.labels)


RECONCILES = _counter(names.OPERATOR_RECONCILES)
RECONCILE_ERRORS = _counter(names.OPERATOR_RECONCILE_ERRORS)
RECONCILE_SECONDS = Histogram(names.OPERATOR_RECONCILE_DURATION.name,
                              names.OPERATOR_RECONCILE_DURATION.help,
                              buckets=RECONCILE_BUCKETS_S)
PLACEMENT_FAILURES = _counter(names.OPERATOR_PLACEMENT_FAILURES)
INSTANCE_RESTARTS = _counter(names.OPERATOR_INSTANCE_RESTARTS)
INSTANCES_CREATED = _counter(names.OPERATOR_INSTANCES_CREATED)
REBALANCE_MOVES = _counter(names.OPERATOR_REBALANCE_MOVES)
POOL_PRESSURE = _gauge(names.OPERATOR_POOL_PRESSURE)
POOL_INSTANCES = _gauge(names.OPERATOR_POOL_INSTANCES)
DESIRED_INSTANCES = _gauge(names.OPERATOR_DESIRED_INSTANCES)
CURRENT_INSTANCES = _gauge(names.OPERATOR_CURRENT_INSTANCES)
MAX_INSTANCES = _gauge(names.OPERATOR_MAX_INSTANCES)
SCALE_DECISIONS = _counter(names.OPERATOR_SCALE_DECISIONS)
DRAINS = _counter(names.OPERATOR_DRAINS)


def replica_label(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def serve(port: int, address: str = "0.0.0.0") -> None:
    start_http_server(port, addr=address)
