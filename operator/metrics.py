"""The operator's own Prometheus metrics (``slipstream_operator_*``), served on --metrics-port.

    handle_reconcile / handle_rebalance --> these counters and gauges --> /metrics

One process runs one operator, so the default registry is fine here (unlike the agent, whose
tests run several apps in one process).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("slipstream_operator_reconciles", "ServingReplica reconciles, by what "
                     "triggered them.", ("trigger",))
RECONCILE_ERRORS = Counter("slipstream_operator_reconcile_errors", "Reconciles that raised "
                           "(they are retried).", ("trigger",))
RECONCILE_SECONDS = Histogram("slipstream_operator_reconcile_duration_seconds",
                              "Wall time of one reconcile, API calls included.",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
PLACEMENT_FAILURES = Counter("slipstream_operator_placement_failures", "Instances that could "
                             "not be placed, by reason.", ("reason",))
INSTANCE_RESTARTS = Counter("slipstream_operator_instance_restarts", "Instances recreated "
                            "because one of their pods failed or vanished.")
INSTANCES_CREATED = Counter("slipstream_operator_instances_created", "Instances whose pods "
                            "were created (new, scaled up or restarted).")
REBALANCE_MOVES = Counter("slipstream_operator_rebalance_moves", "Instances moved between "
                          "prefill pools.", ("from_pool", "to_pool"))
POOL_PRESSURE = Gauge("slipstream_operator_pool_pressure", "P90 instance pressure of a pool "
                      "at the last rebalancer step.", ("namespace", "replica", "pool"))
POOL_INSTANCES = Gauge("slipstream_operator_pool_instances", "Instances in a pool at the last "
                       "rebalancer step.", ("namespace", "replica", "pool"))


def serve(port: int, address: str = "0.0.0.0") -> None:
    start_http_server(port, addr=address)
