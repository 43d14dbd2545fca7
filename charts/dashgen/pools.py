"""The pools and rebalancing dashboard: how instances are split between the short- and
long-prefill pools (PLA-Serve), each pool's load and latency as the agents see it, how the
router splits and queues traffic (``slipstream router``), and what the operator did about it
(moves, restarts, placement failures, reconciles, the autoscaler's decisions and drains)."""

from __future__ import annotations

from dashgen.grafana import Panel, Target, dashboard, query_variable, stat, timeseries
from dashgen.queries import RATE, REQUEST_FILTER, in_pool, match, quantile, selector
from slipstream.contracts import metric_names as names

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


def _router_row() -> list[Panel]:
    # The router is its own scrape job, so its panels filter by pool only, not by $job.
    pool = 'pool=~"$pool"'
    return [
        timeseries("Routed requests by class and pool", "Requests the router finished per "
                   "second, by prompt class, the pool that served them and outcome.",
                   Target(f"sum by (request_class, pool, outcome) "
                          f"(rate({names.ROUTER_REQUESTS.name}{{{pool}}}[{RATE}]))",
                          "{{request_class}} -> {{pool}} {{outcome}}"), unit="reqps", width=8),
        timeseries("Router TTFT p99", "Arrival at the router to the first token leaving it: "
                   "fair-queue wait, retries and the instance's own TTFT.",
                   Target(quantile(0.99, names.ROUTER_TTFT, "request_class, pool", labels=pool),
                          "{{request_class}} -> {{pool}}"), unit="s", width=8),
        timeseries("Retries before the first token", "Attempts moved to another instance of "
                   "the pool after one failed before its first token.",
                   Target(f"sum by (pool) (rate({names.ROUTER_RETRIES.name}{{{pool}}}"
                          f"[{RATE}]))", "{{pool}}"), unit="ops", width=8),
        timeseries("Fair queue", "Requests waiting because every candidate instance is "
                   "saturated (left) and their p99 wait (right).",
                   Target(f"sum by (request_class) ({names.ROUTER_QUEUE_DEPTH.name})",
                          "waiting {{request_class}}"),
                   Target(quantile(0.99, names.ROUTER_QUEUE_WAIT, "request_class", labels=""),
                          "p99 wait {{request_class}}"),
                   right_axis=("p99 wait short", "p99 wait long"), width=8),
        timeseries("Router view of the pools", "Instances the router routes to per pool "
                   "label, and its requests in flight there.",
                   Target(f"max by (pool) ({names.ROUTER_POOL_INSTANCES.name}{{{pool}}})",
                          "instances {{pool}}"),
                   Target(f"sum by (pool) ({names.ROUTER_IN_FLIGHT.name}{{{pool}}})",
                          "in flight {{pool}}"), width=8),
        timeseries("Predicted backlog by pool", "The router's least-backlog input: pending "
                   "prefill tokens plus weighted decodes, summed over each pool.",
                   Target(f"sum by (pool) ({names.ROUTER_BACKLOG_TOKENS.name}{{{pool}}})",
                          "{{pool}}"), width=8),
        timeseries("Router requests by tenant", "Requests per second at the router by the API "
                   "key's tenant and outcome (refused keys, other tenants' app_ids, rate "
                   "limits); the agents check the same key again.",
                   Target(f"sum by (tenant, outcome) "
                          f"(rate({names.ROUTER_TENANT_REQUESTS.name}[{RATE}]))",
                          "{{tenant}} {{outcome}}"), unit="reqps", width=24),
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
        stat("Instances created", "Instances whose pods the operator created (new, scaled "
             "up or recreated).",
             Target(f"sum (increase({names.OPERATOR_INSTANCES_CREATED.name}[$__range]))")),
        timeseries("Reconciles by result", "Reconciliations per second by result.",
                   Target(f"sum by (result) (rate({names.OPERATOR_RECONCILES.name}[{RATE}]))",
                          "{{result}}"), unit="ops", width=12),
        timeseries("Reconcile duration", "Wall time of one reconciliation (API calls and "
                   "the replica's lock included).",
                   *(Target(quantile(q, names.OPERATOR_RECONCILE_DURATION, labels=""),
                            f"p{round(q * 100)}") for q in (0.5, 0.99)),
                   unit="s", width=12),
    ]


def _autoscaler_row() -> list[Panel]:
    desired, current = names.OPERATOR_DESIRED_INSTANCES.name, names.OPERATOR_CURRENT_INSTANCES.name
    return [
        timeseries("Desired and current instances", "The autoscaler's decision against the "
                   "instances serving or starting when it decided, and spec.autoscaling."
                   "maxInstances.",
                   Target(f"max by (replica) ({desired})", "desired {{replica}}"),
                   Target(f"max by (replica) ({current})", "current {{replica}}"),
                   Target(f"max by (replica) ({names.OPERATOR_MAX_INSTANCES.name})",
                          "max {{replica}}"), width=8),
        timeseries("Scale decisions by reason", "Autoscaler decisions per period, by outcome "
                   "(ScaleUp, ScaleDown, WithinTargets, Stabilizing, AtMaxInstances, ...).",
                   Target(f"sum by (reason) (increase({names.OPERATOR_SCALE_DECISIONS.name}"
                          f"[$__interval]))", "{{reason}}"), width=8),
        timeseries("Drains", "Instances removed after a drain: finished with nothing in "
                   "flight, or deleted at drainTimeoutSeconds.",
                   Target(f"sum by (outcome) (increase({names.OPERATOR_DRAINS.name}"
                          f"[$__range]))", "{{outcome}}"), width=8),
    ]


def build() -> dict:
    role = names.POOL_ROLE.name
    variables = [
        query_variable("job", "Job", f"label_values({role}, job)"),
        query_variable("pool", "Pool", f'label_values({role}{{job=~"$job"}}, pool)'),
    ]
    rows = [("Pools as the agents see them", _agent_row()),
            ("Router: length-aware routing and fair queuing", _router_row()),
            ("Operator: placement and rebalancing", _operator_row()),
            ("Operator: autoscaling", _autoscaler_row())]
    return dashboard(UID, "Slipstream / Pools and rebalancing", "Short/long prefill pools: "
                     "their split, load and latency, and the operator's moves.", rows, variables)
