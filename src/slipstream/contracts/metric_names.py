"""Every Prometheus metric Slipstream exports, by its exposed name: the one list that the agent's
metrics, the operator's metrics, the Grafana dashboards and the alert rules agree on.

    metric_names.AGENT_METRICS    -> agent/server/metrics.py registers them, /metrics shows them
    metric_names.OPERATOR_METRICS -> the operator registers them
    metric_names.ROUTER_METRICS   -> agent/router/metrics.py (``slipstream router``'s /metrics)
    both                          -> charts' dashboards and alert rules may only query these

Names follow Prometheus conventions: the ``slipstream_`` prefix, base units in the name
(``_seconds``, ``_tokens``, ``_ratio``), ``_total`` on counters, ``_info`` on constant-1
gauges that carry labels. Names here are the exposed family names, so counters include
``_total`` (``prometheus_client`` adds it back when given a name without it).

This module imports nothing, so the operator can use it without pulling in the agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]

REQUEST_LABELS = ("request_class", "pool")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str

    @property
    def constructor_name(self) -> str:
        """The name ``prometheus_client`` constructors expect (counters without ``_total``)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


def _spec(name: str, type_: MetricType, labels: tuple[str, ...], help_text: str) -> MetricSpec:
    return MetricSpec(name, type_, labels, help_text)


# -- agent: per request (recorded by the HTTP layer as outputs stream) ---------------------------
TTFT = _spec("slipstream_time_to_first_token_seconds", "histogram", REQUEST_LABELS,
             "Arrival to first output token.")
TPOT = _spec("slipstream_time_per_output_token_seconds", "histogram", REQUEST_LABELS,
             "Mean time per output token after the first, per request.")
ITL = _spec("slipstream_inter_token_latency_seconds", "histogram", REQUEST_LABELS,
            "Gap between successive token deliveries to the API layer.")
E2E = _spec("slipstream_e2e_request_latency_seconds", "histogram", REQUEST_LABELS,
            "Arrival to the last output token.")
REQUESTS = _spec("slipstream_requests_total", "counter", ("finish_reason",),
                 "Finished requests by finish reason.")
PROMPT_TOKENS = _spec("slipstream_prompt_tokens_total", "counter", (),
                      "Prompt tokens of finished requests.")
GENERATION_TOKENS = _spec("slipstream_generation_tokens_total", "counter", (),
                          "Tokens generated and delivered.")
SLO_REQUESTS = _spec("slipstream_slo_requests_total", "counter",
                     ("slo", "outcome", *REQUEST_LABELS),
                     "Finished requests that carried an SLO, by objective (ttft, tpot, or all "
                     "of them) and outcome (met, missed).")
REQUESTS_IN_FLIGHT = _spec("slipstream_requests_in_flight", "gauge", (*REQUEST_LABELS, "phase"),
                           "Accepted, unfinished requests by class: phase=prefill before the "
                           "first token (queued or prefilling), phase=decode after it.")

# -- agent: engine state (read from a snapshot when scraped) ------------------------------------
QUEUE_DEPTH = _spec("slipstream_queue_depth", "gauge", ("state",),
                    "Requests in the scheduler by state (waiting, running).")
KV_BLOCKS_USED = _spec("slipstream_kv_cache_blocks_used", "gauge", (), "Paged KV blocks in use.")
KV_BLOCKS_CAPACITY = _spec("slipstream_kv_cache_blocks_capacity", "gauge", (),
                        "Paged KV blocks in the cache.")
PREEMPTIONS = _spec("slipstream_preemptions_total", "counter", (),
                    "Requests preempted (recompute or swap) since start.")
KVP_ACTIVE_DEGREE = _spec("slipstream_kvp_active_degree", "gauge", (),
                          "KV-parallel groups spanned by the widest running request.")
PREFIX_CACHE_QUERIES = _spec("slipstream_prefix_cache_query_tokens_total", "counter", (),
                             "Prompt tokens looked up in the prefix cache (at admission).")
PREFIX_CACHE_HITS = _spec("slipstream_prefix_cache_hit_tokens_total", "counter", (),
                          "Prompt tokens whose KV the prefix cache already held; hit rate = "
                          "rate(hits) / rate(queries).")
PREFIX_CACHE_EVICTIONS = _spec("slipstream_prefix_cache_evicted_blocks_total", "counter", (),
                               "Cached prefix blocks evicted to make room for new KV.")
KV_BLOCKS_CACHED = _spec("slipstream_kv_cache_blocks_cached", "gauge", (),
                         "Paged KV blocks holding a reusable prefix block (in use or free).")
KV_TRANSFERS = _spec("slipstream_kv_transfers_total", "counter", ("outcome",),
                     "KV hand-offs between disaggregated instances by outcome: on a prefill "
                     "instance acknowledged (a decode instance fetched the KV) or expired; on a "
                     "decode instance completed or failed.")
KV_TRANSFER_BLOCKS = _spec("slipstream_kv_transfer_blocks_total", "counter", ("source",),
                           "Prompt KV blocks a decode instance needed, by source: transferred "
                           "from a prefill instance, or prefix_cache (already held here, not "
                           "transferred).")
KV_TRANSFER_BYTES = _spec("slipstream_kv_transfer_bytes_total", "counter", (),
                          "KV bytes a decode instance read from prefill instances.")
KV_TRANSFER_OVERLAPPED_BLOCKS = _spec(
    "slipstream_kv_transfer_overlapped_blocks_total", "counter", (),
    "Transferred prompt KV blocks a decode instance read while the prefill instance was still "
    "computing later chunks of the same prompt (streaming hand-off).")
KV_TIER_HITS = _spec("slipstream_kv_tier_hit_tokens_total", "counter", ("tier",),
                    "Prompt tokens found cached at admission, by the tier that held them: "
                    "device (the GPU's KV pool), host or disk (loaded back, not recomputed).")
KV_TIER_BYTES = _spec("slipstream_kv_tier_bytes_total", "counter", ("direction",),
                      "KV bytes moved between tiers: device_to_host (offloaded evictions), "
                      "host_to_device (loads), host_to_disk (spills), disk_to_host (fetches).")
KV_TIER_LOAD_SECONDS = _spec("slipstream_kv_tier_load_seconds_total", "counter", ("tier",),
                             "Seconds spent bringing KV up a tier: host (host -> device, on "
                             "the step) and disk (disk -> host, in the background).")
KV_TIER_BLOCKS_USED = _spec("slipstream_kv_tier_blocks_used", "gauge", ("tier",),
                            "KV blocks a lower tier (host, disk) holds.")
KV_TIER_BLOCKS_CAPACITY = _spec("slipstream_kv_tier_blocks_capacity", "gauge", ("tier",),
                                "KV blocks a lower tier (host, disk) can hold.")
KV_TIER_FAILED_BLOCKS = _spec("slipstream_kv_tier_failed_blocks_total", "counter", (),
                              "Blocks a failing tier dropped (a corrupt or unreadable disk "
                              "block, a failed write); their tokens are computed instead.")
KV_TIER_NAMES = ("device", "host", "disk")
KV_TIER_DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")
KV_TRANSFER_OUTCOMES = ("acknowledged", "expired", "completed", "failed")
KV_TRANSFER_SOURCES = ("transferred", "prefix_cache")

# -- agent: per engine step (recorded by the step observer) -------------------------------------
PREFILL_CHUNK_TOKENS = _spec("slipstream_prefill_chunk_tokens", "histogram", (),
                             "Tokens in each scheduled prefill chunk (adaptive chunking).")
BATCH_TOKENS = _spec("slipstream_batch_tokens", "histogram", (),
                     "Tokens in each executed batch (decodes plus prefill chunks).")
BATCH_TIME_ACTUAL = _spec("slipstream_batch_time_actual_seconds", "histogram", (),
                          "Measured execution time of each batch (inputs, forward, sampling).")
BATCH_TIME_PREDICTED = _spec("slipstream_batch_time_predicted_seconds", "histogram", (),
                             "The runtime predictor's estimate for each batch, when the packer "
                             "made one.")
SCHEDULE_TIME = _spec("slipstream_schedule_time_seconds", "histogram", (),
                      "Time the scheduler took to build each batch.")
SCHEDULED_TOKENS = _spec("slipstream_scheduled_tokens_total", "counter", ("phase",),
                         "Tokens executed, by phase (prefill, decode).")

# -- agent: identity and configuration ----------------------------------------------------------
POOL_ROLE = _spec("slipstream_pool_role_info", "gauge", ("pool",),
                  "Always 1; the pool label says which prefill pool this instance serves.")
SLO_TTFT_TARGET = _spec("slipstream_slo_ttft_target_seconds", "gauge", (),
                        "The default TTFT objective applied to requests without their own.")
SLO_TPOT_TARGET = _spec("slipstream_slo_tpot_target_seconds", "gauge", (),
                        "The default TPOT objective applied to requests without their own.")
SLO_ATTAINMENT_TARGET = _spec("slipstream_slo_attainment_target_ratio", "gauge", (),
                              "Share of requests that should meet their SLO (alert threshold).")

# -- agent and router: tenants (--tenants FILE; tenancy/). ``tenant`` is a name from the tenants
# file (the first 100; later ones share "other") or "none" before a key was accepted, so its
# values are bounded by the file, never by what clients send.
TENANT_OUTCOMES = "ok, unauthenticated, forbidden, rate_limited, rejected (other 4xx), error"
TENANT_REQUESTS = _spec("slipstream_tenant_requests_total", "counter", ("tenant", "outcome"),
                        f"API requests by tenant and outcome ({TENANT_OUTCOMES}).")
TENANT_SLO_CLAMPED = _spec("slipstream_tenant_slo_clamped_total", "counter", ("tenant",),
                           "Requests whose SLO asked for more than the tenant's tightest class "
                           "and was raised to it.")

AGENT_METRICS: tuple[MetricSpec, ...] = (
    TTFT, TPOT, ITL, E2E, REQUESTS, PROMPT_TOKENS, GENERATION_TOKENS, SLO_REQUESTS,
    REQUESTS_IN_FLIGHT, QUEUE_DEPTH, KV_BLOCKS_USED, KV_BLOCKS_CAPACITY, PREEMPTIONS,
    KVP_ACTIVE_DEGREE, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREFIX_CACHE_EVICTIONS,
    KV_BLOCKS_CACHED, KV_TRANSFERS, KV_TRANSFER_BLOCKS, KV_TRANSFER_BYTES,
    KV_TRANSFER_OVERLAPPED_BLOCKS, KV_TIER_HITS, KV_TIER_BYTES, KV_TIER_LOAD_SECONDS,
    KV_TIER_BLOCKS_USED, KV_TIER_BLOCKS_CAPACITY, KV_TIER_FAILED_BLOCKS, PREFILL_CHUNK_TOKENS, BATCH_TOKENS, BATCH_TIME_ACTUAL,
    BATCH_TIME_PREDICTED, SCHEDULE_TIME, SCHEDULED_TOKENS, POOL_ROLE, SLO_TTFT_TARGET,
    SLO_TPOT_TARGET, SLO_ATTAINMENT_TARGET, TENANT_REQUESTS, TENANT_SLO_CLAMPED)

# -- operator ----------------------------------------------------------------------------------
OPERATOR_RECONCILES = _spec("slipstream_operator_reconciles_total", "counter", ("result",),
                            "Reconciliations of ServingReplicas by result (success, error).")
OPERATOR_RECONCILE_ERRORS = _spec("slipstream_operator_reconcile_errors_total", "counter", (),
                                  "Reconciliations that raised.")
OPERATOR_PLACEMENT_FAILURES = _spec("slipstream_operator_placement_failures_total", "counter", (),
                                    "Instances that could not be placed (gang did not fit).")
OPERATOR_REBALANCE_MOVES = _spec("slipstream_operator_rebalance_moves_total", "counter",
                                 ("from_pool", "to_pool"),
                                 "Instances moved between prefill pools by the rebalancer.")
OPERATOR_INSTANCE_RESTARTS = _spec("slipstream_operator_instance_restarts_total", "counter", (),
                                   "Instances recreated after one of their pods failed.")
OPERATOR_POOL_INSTANCES = _spec("slipstream_operator_pool_instances", "gauge",
                                ("replica", "pool"), "Instances per pool of each ServingReplica.")
OPERATOR_POOL_PRESSURE = _spec("slipstream_operator_pool_pressure", "gauge", ("replica", "pool"),
                               "P90 instance pressure of each pool, as the rebalancer saw it.")
OPERATOR_DESIRED_INSTANCES = _spec("slipstream_operator_desired_instances", "gauge", ("replica",),
                                   "Instances the autoscaler last decided on.")
OPERATOR_CURRENT_INSTANCES = _spec("slipstream_operator_current_instances", "gauge", ("replica",),
                                   "Instances serving or starting when the autoscaler "
                                   "decided (draining ones not counted).")
OPERATOR_MAX_INSTANCES = _spec("slipstream_operator_max_instances", "gauge", ("replica",),
                               "spec.autoscaling.maxInstances of each autoscaled replica.")
OPERATOR_SCALE_DECISIONS = _spec("slipstream_operator_scale_decisions_total", "counter",
                                 ("replica", "reason"),
                                 "Autoscaler decisions by outcome (ScaleUp, ScaleDown, "
                                 "WithinTargets, Stabilizing, AtMaxInstances, ...).")
OPERATOR_DRAINS = _spec("slipstream_operator_drains_total", "counter", ("outcome",),
                        "Instances drained and deleted: finished (nothing in flight) or "
                        "timed_out (drainTimeoutSeconds passed).")

OPERATOR_RECONCILE_DURATION = _spec("slipstream_operator_reconcile_duration_seconds",
                                    "histogram", (), "Wall time of one reconciliation, API "
                                    "calls and waiting for the replica's lock included.")
OPERATOR_INSTANCES_CREATED = _spec("slipstream_operator_instances_created_total", "counter", (),
                                   "Instances whose pods were created (new, scaled up or "
                                   "recreated).")

OPERATOR_METRICS: tuple[MetricSpec, ...] = (
    OPERATOR_RECONCILES, OPERATOR_RECONCILE_ERRORS, OPERATOR_PLACEMENT_FAILURES,
    OPERATOR_REBALANCE_MOVES, OPERATOR_INSTANCE_RESTARTS, OPERATOR_POOL_INSTANCES,
    OPERATOR_POOL_PRESSURE, OPERATOR_RECONCILE_DURATION, OPERATOR_INSTANCES_CREATED,
    OPERATOR_DESIRED_INSTANCES, OPERATOR_CURRENT_INSTANCES, OPERATOR_MAX_INSTANCES,
    OPERATOR_SCALE_DECISIONS, OPERATOR_DRAINS)

# -- router (``slipstream router``: length-aware pools, fair queuing) ---------------------------
ROUTER_LABELS = ("request_class", "pool")
ROUTER_REQUESTS = _spec("slipstream_router_requests_total", "counter", (*ROUTER_LABELS, "outcome"),
                        "Requests the router finished, by class, the pool that served them and "
                        "outcome (ok, error, rejected: no instance took it, cancelled: the "
                        "client left).")
ROUTER_RETRIES = _spec("slipstream_router_retries_total", "counter", ("pool",),
                       "Attempts moved to another instance after one failed before the first "
                       "token.")
ROUTER_TTFT = _spec("slipstream_router_time_to_first_token_seconds", "histogram", ROUTER_LABELS,
                    "Arrival at the router to the first token leaving it (fair-queue wait, "
                    "retries and the instance's TTFT).")
ROUTER_QUEUE_WAIT = _spec("slipstream_router_queue_wait_seconds", "histogram",
                          ("request_class",),
                          "Time a request waited in the router's fair queue for a free "
                          "instance.")
ROUTER_QUEUE_DEPTH = _spec("slipstream_router_queue_depth", "gauge", ("request_class",),
                           "Requests waiting in the router's fair queue (all candidate "
                           "instances saturated).")
ROUTER_IN_FLIGHT = _spec("slipstream_router_requests_in_flight", "gauge", ("pool",),
                         "Requests the router has sent to instances of each pool and not yet "
                         "finished.")
ROUTER_POOL_INSTANCES = _spec("slipstream_router_pool_instances", "gauge", ("pool",),
                              "Instances the router currently routes to, by pool label.")
ROUTER_BACKLOG_TOKENS = _spec("slipstream_router_backlog_tokens", "gauge", ("pool",),
                              "Predicted backlog (prefill tokens, decodes weighted) summed over "
                              "each pool's instances.")

ROUTER_TENANT_REQUESTS = _spec("slipstream_router_tenant_requests_total", "counter",
                               ("tenant", "outcome"),
                               f"Requests at the router by tenant and outcome "
                               f"({TENANT_OUTCOMES}).")

ROUTER_METRICS: tuple[MetricSpec, ...] = (
    ROUTER_REQUESTS, ROUTER_RETRIES, ROUTER_TTFT, ROUTER_QUEUE_WAIT, ROUTER_QUEUE_DEPTH,
    ROUTER_IN_FLIGHT, ROUTER_POOL_INSTANCES, ROUTER_BACKLOG_TOKENS, ROUTER_TENANT_REQUESTS)

ALL_METRICS: dict[str, MetricSpec] = {
    spec.name: spec for spec in AGENT_METRICS + OPERATOR_METRICS + ROUTER_METRICS}

# Series Prometheus makes itself for every target; queries may use them too.
PROMETHEUS_BUILTINS = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def family_of(series_name: str) -> MetricSpec | None:
    """The registered family a series name belongs to (``x_bucket`` -> ``x``), or None."""
    if series_name in ALL_METRICS:
        return ALL_METRICS[series_name]
    for suffix in _HISTOGRAM_SUFFIXES:
        spec = ALL_METRICS.get(series_name.removesuffix(suffix))
        if series_name.endswith(suffix) and spec is not None and spec.type == "histogram":
            return spec
    return None
