"""The pools and rebalancing dashboard: how instances are split between the short- and
long-prefill pools (PLA-Serve), each pool's load and latency as the agents see it, and what
the operator did about it (moves, restarts, placement failures, reconciles)."""

from __future__ import annotations

from dashgen.grafana import Panel, Target, dashboard, query_variable, stat, timeseries
from dashgen.queries import RATE, REQUEST_FILTER, in_pool, match, quantile, selector
from slipstream.agent.server import metric_names as names

UID = "slipstream-pools"
AGENT_FILTER = '{job=~"$job"}'


def _agent_row() -> list[Panel]:
    role = names.POOL_ROLE.name
    kv_used = in_pool(f"{names.KV_BLOCKS_USED.name}{AGENT_FILTER}")
    kv_capacity = in_pool(f"{names.KV_BLOCKS_CAPACITY.name}{AGENT_FILTER}")
    slo_requests = names.SLO_REQUESTS.name
    return [
        timeseries("Agents per pool", "Agents reporting each pool role.",
                   Target(f'count by (pool) ({role}{{job=~"$job", pool=~"$pool"}})',
                          "{{pool}}"), width=8),
        timeseries("Requests per second by pool", "Requests that got their first token.",
                   Target(f"sum by (pool) (rate({names.TTFT.name}_count"
                          f"{selector(REQUEST_FILTER)}[{RATE}]))", "{{pool}}"),
                   unit="reqps", width=8),
        timeseries("Prefill backlog by pool", "Requests before their first token, per pool "
                   "and class: the queue backlog the rebalancer weighs.",
                   Target(f"sum by (pool, request_class) ({names.REQUESTS_IN_FLIGHT.name}"
                          f'{selector(REQUEST_FILTER, match(phase="prefill"))})',
                          "{{pool}} {{request_class}}"), width=8),
        timeseries("TTFT p99 by pool", "Time to first token per pool and class.",
                   Target(quantile(0.99, names.TTFT, "pool, request_class"),
                          "{{pool}} {{request_class}}"), unit="s", width=8),
        timeseries("KV cache usage by pool", "Share of the pool's KV blocks in use.",
                   Target(f"sum by (pool) ({kv_used}) / sum by (pool) ({kv_capacity})",
                          "{{pool}}"), unit="percentunit", width=8),
        timeseries("SLO attainment by pool", "Share of requests that met all their objectives.",
                   Target(f"sum by (pool) (rate({slo_requests}"
                          f'{selector(REQUEST_FILTER, match(slo="all", outcome="met"))}'
                          f"[{RATE}])) / sum by (pool) (rate({slo_requests}"
                          f'{selector(REQUEST_FILTER, match(slo="all"))}[{RATE}]))',
                          "{{pool}}"), unit="percentunit", width=8),
    ]


def _operator_row() -> list[Panel]:
    pool_instances = names.OPERATOR_POOL_INSTANCES.name
    return [
        timeseries("Instances per pool (operator)", "The operator's split of each "
                   "ServingReplica's instances.",
                   Target(f'sum by (replica, pool) ({pool_instances}{{pool=~"$pool"}})',
                          "{{replica}} {{pool}}"), width=8),
        timeseries("Pool pressure (P90)", "The rebalancer's input: P90 instance pressure per "
                   "pool; a move happens when the gap exceeds the hysteresis after cooldown.",
                   Target(f'max by (replica, pool) ({names.OPERATOR_POOL_PRESSURE.name}'
                          f'{{pool=~"$pool"}})', "{{replica}} {{pool}}"), width=8),
        timeseries("Rebalance moves", "Instances relabelled from one pool to the other.",
                   Target(f"sum by (from_pool, to_pool) "
                          f"(increase({names.OPERATOR_REBALANCE_MOVES.name}[$__range]))",
                          "{{from_pool}} -> {{to_pool}}"), width=8),
        stat("Instance restarts", "Instances recreated after a pod failed (whole gang).",
             Target(f"sum (increase({names.OPERATOR_INSTANCE_RESTARTS.name}[$__range]))")),
        stat("Placement failures", "Instances that did not fit on the cluster's GPUs.",
             Target(f"sum (increase({names.OPERATOR_PLACEMENT_FAILURES.name}[$__range]))")),
        stat("Reconcile errors", "Reconciliations that raised.",
             Target(f"sum (increase({names.OPERATOR_RECONCILE_ERRORS.name}[$__range]))")),
        stat("Reconciles per second", "All reconciliations.",
             Target(f"sum (rate({names.OPERATOR_RECONCILES.name}[{RATE}]))"), unit="ops"),
        timeseries("Reconciles by result", "Reconciliations per second by result.",
                   Target(f"sum by (result) (rate({names.OPERATOR_RECONCILES.name}[{RATE}]))",
                          "{{result}}"), unit="ops", width=24),
    ]


def build() -> dict:
    role = names.POOL_ROLE.name
    variables = [
        query_variable("job", "Job", f"label_values({role}, job)"),
        query_variable("pool", "Pool", f'label_values({role}{{job=~"$job"}}, pool)'),
    ]
    rows = [("Pools as the agents see them", _agent_row()),
            ("Operator: placement and rebalancing", _operator_row())]
    return dashboard(UID, "Slipstream / Pools and rebalancing", "Short/long prefill pools: "
                     "their split, load and latency, and the operator's moves.", rows, variables)
