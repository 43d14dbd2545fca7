"""The instance internals dashboard: what one agent's engine is doing each iteration (queues,
KV cache, preemptions, prefix-cache hit rate, batch composition, adaptive chunk sizes, predicted against actual
batch time, scheduling cost, KVP degree)."""

from __future__ import annotations

from dashgen.grafana import Panel, Target, dashboard, query_variable, table, timeseries
from dashgen.queries import INSTANCE_FILTER, RATE, mean, quantile
from slipstream.contracts import metric_names as names

UID = "slipstream-instance-internals"
SEL = "{" + INSTANCE_FILTER + "}"


def _state_row() -> list[Panel]:
    used, capacity = names.KV_BLOCKS_USED.name, names.KV_BLOCKS_CAPACITY.name
    return [
        timeseries("Scheduler queues", "Requests waiting for admission and running, per "
                   "instance.",
                   Target(f"sum by (instance, state) ({names.QUEUE_DEPTH.name}{SEL})",
                          "{{instance}} {{state}}"), width=8),
        timeseries("Requests in flight by class", "Before the first token (prefill) and after "
                   "it (decode), by request class.",
                   Target(f"sum by (request_class, phase) "
                          f"({names.REQUESTS_IN_FLIGHT.name}{SEL})",
                          "{{request_class}} {{phase}}"), width=8),
        timeseries("KV cache usage", "Share of paged KV blocks in use; the saturation alert "
                   "fires above 95% for 10 minutes.",
                   Target(f"sum by (instance) ({used}{SEL}) / sum by (instance) "
                          f"({capacity}{SEL})", "{{instance}}"), unit="percentunit", width=8),
        timeseries("KV blocks", "Blocks in use and the cache's capacity.",
                   Target(f"sum by (instance) ({used}{SEL})", "used {{instance}}"),
                   Target(f"sum by (instance) ({capacity}{SEL})", "capacity {{instance}}"),
                   width=8),
        timeseries("Preemptions per second", "Requests preempted (recompute or swap) because "
                   "KV blocks ran out.",
                   Target(f"sum by (instance) (rate({names.PREEMPTIONS.name}{SEL}[{RATE}]))",
                          "{{instance}}"), width=8),
        timeseries("Active KVP degree", "KV-parallel groups spanned by the widest running "
                   "request (progressive KVP).",
                   Target(f"max by (instance) ({names.KVP_ACTIVE_DEGREE.name}{SEL})",
                          "{{instance}}"), width=8),
    ]


def _prefix_cache_row() -> list[Panel]:
    queries, hits = names.PREFIX_CACHE_QUERIES.name, names.PREFIX_CACHE_HITS.name
    return [
        timeseries("Prefix cache hit rate", "Share of prompt tokens whose KV the prefix cache "
                   "already held at admission (those tokens are not prefilled again).",
                   Target(f"sum by (instance) (rate({hits}{SEL}[{RATE}])) / sum by (instance) "
                          f"(rate({queries}{SEL}[{RATE}]))", "{{instance}}"),
                   unit="percentunit", width=8),
        timeseries("Prefix cache tokens per second", "Prompt tokens looked up in the cache and "
                   "found there.",
                   Target(f"sum by (instance) (rate({queries}{SEL}[{RATE}]))",
                          "looked up {{instance}}"),
                   Target(f"sum by (instance) (rate({hits}{SEL}[{RATE}]))", "hit {{instance}}"),
                   width=8),
        timeseries("Prefix cache blocks and evictions", "Blocks holding a reusable prefix, "
                   "and cached blocks evicted per second to make room.",
                   Target(f"sum by (instance) ({names.KV_BLOCKS_CACHED.name}{SEL})",
                          "cached {{instance}}"),
                   Target(f"sum by (instance) "
                          f"(rate({names.PREFIX_CACHE_EVICTIONS.name}{SEL}[{RATE}]))",
                          "evicted/s {{instance}}"), width=8),
    ]


def _kv_tier_row() -> list[Panel]:
    hits, moved = names.KV_TIER_HITS.name, names.KV_TIER_BYTES.name
    return [
        timeseries("Prefix hits by tier", "Prompt tokens per second found cached at admission, "
                   "by the tier that held them: device (GPU pool), host or disk (loaded back "
                   "instead of recomputed).",
                   Target(f"sum by (tier) (rate({hits}{SEL}[{RATE}]))", "{{tier}}"), width=6),
        timeseries("KV tier bytes per second", "KV moved between tiers: evictions offloaded "
                   "to host, loads to the device, spills to disk, fetches from disk.",
                   Target(f"sum by (direction) (rate({moved}{SEL}[{RATE}]))", "{{direction}}"),
                   unit="Bps", width=6),
        timeseries("KV tier load time", "Seconds per second spent bringing KV up a tier (host "
                   "-> device on the engine step, disk -> host in the background).",
                   Target(f"sum by (tier) (rate({names.KV_TIER_LOAD_SECONDS.name}{SEL}"
                          f"[{RATE}]))", "{{tier}}"), width=6),
        timeseries("KV tier occupancy", "Share of each lower tier holding blocks, and blocks "
                   "a failing tier dropped (corrupt or unwritable disk blocks) per second.",
                   # clamp_min: an agent without tiers reports a capacity of 0 (shown as 0).
                   Target(f"sum by (tier) ({names.KV_TIER_BLOCKS_USED.name}{SEL}) / clamp_min("
                          f"sum by (tier) ({names.KV_TIER_BLOCKS_CAPACITY.name}{SEL}), 1)",
                          "{{tier}}"),
                   Target(f"sum (rate({names.KV_TIER_FAILED_BLOCKS.name}{SEL}[{RATE}]))",
                          "dropped/s"), width=6),
    ]


def _kv_transfer_row() -> list[Panel]:
    transfers, blocks = names.KV_TRANSFERS.name, names.KV_TRANSFER_BLOCKS.name
    return [
        timeseries("KV transfers per second", "Disaggregation: hand-offs acknowledged or "
                   "expired on prefill instances, completed or failed on decode instances. "
                   "Zero on mixed instances.",
                   Target(f"sum by (instance, outcome) (rate({transfers}{SEL}[{RATE}]))",
                          "{{outcome}} {{instance}}"), width=8),
        timeseries("KV transfer blocks per second", "Prompt blocks decode instances needed: "
                   "transferred from a prefill instance, or found in their own prefix cache; and "
                   "those read while their prompt was still prefilling (streaming hand-off).",
                   Target(f"sum by (instance, source) (rate({blocks}{SEL}[{RATE}]))",
                          "{{source}} {{instance}}"),
                   Target(f"sum by (instance) (rate({names.KV_TRANSFER_OVERLAPPED_BLOCKS.name}"
                          f"{SEL}[{RATE}]))", "read during prefill {{instance}}"), width=8),
        timeseries("KV transfer bytes per second", "Bytes decode instances read from prefill "
                   "instances.",
                   Target(f"sum by (instance) (rate({names.KV_TRANSFER_BYTES.name}{SEL}"
                          f"[{RATE}]))", "{{instance}}"), unit="Bps", width=8),
    ]


def _batch_row() -> list[Panel]:
    actual, predicted = names.BATCH_TIME_ACTUAL, names.BATCH_TIME_PREDICTED
    return [
        timeseries("Batch time: predicted against actual", "p50 and p99 of the runtime "
                   "predictor's estimate and of the measured execution time. Predicted stays "
                   "empty until the packer predicts.",
                   Target(quantile(0.5, actual, labels=INSTANCE_FILTER), "actual p50"),
                   Target(quantile(0.99, actual, labels=INSTANCE_FILTER), "actual p99"),
                   Target(quantile(0.5, predicted, labels=INSTANCE_FILTER), "predicted p50"),
                   Target(quantile(0.99, predicted, labels=INSTANCE_FILTER), "predicted p99"),
                   unit="s"),
        timeseries("Mean batch time: actual / predicted", "Above 1 the predictor is "
                   "optimistic and batches overrun the time budget; refresh the profile.",
                   Target(f"({mean(actual, labels=INSTANCE_FILTER)}) / "
                          f"({mean(predicted, labels=INSTANCE_FILTER)})", "actual / predicted"),
                   Target(mean(actual, labels=INSTANCE_FILTER), "mean actual (s)")),
        timeseries("Prefill chunk size", "Tokens per prefill chunk: with a fixed time budget, "
                   "early chunks are large and late (attention-heavy) chunks small.",
                   Target(quantile(0.5, names.PREFILL_CHUNK_TOKENS, labels=INSTANCE_FILTER),
                          "p50"),
                   Target(quantile(0.99, names.PREFILL_CHUNK_TOKENS, labels=INSTANCE_FILTER),
                          "p99"),
                   Target(mean(names.PREFILL_CHUNK_TOKENS, labels=INSTANCE_FILTER), "mean"),
                   width=8),
        timeseries("Tokens per batch", "Decodes plus prefill chunk tokens in each iteration.",
                   Target(quantile(0.5, names.BATCH_TOKENS, labels=INSTANCE_FILTER), "p50"),
                   Target(quantile(0.99, names.BATCH_TOKENS, labels=INSTANCE_FILTER), "p99"),
                   width=8),
        timeseries("Scheduled tokens per second", "Tokens executed, by phase.",
                   Target(f"sum by (phase) (rate({names.SCHEDULED_TOKENS.name}{SEL}[{RATE}]))",
                          "{{phase}}"), width=8),
        timeseries("Scheduling time p99", "Time the scheduler took to build a batch: the CPU "
                   "cost of the policy and the packer, per iteration.",
                   Target(quantile(0.99, names.SCHEDULE_TIME, labels=INSTANCE_FILTER), "p99"),
                   Target(mean(names.SCHEDULE_TIME, labels=INSTANCE_FILTER), "mean"),
                   unit="s", width=12),
        timeseries("Iterations per second", "Engine steps that executed a batch.",
                   Target(f"sum by (instance) (rate({actual.name}_count{SEL}[{RATE}]))",
                          "{{instance}}"), width=12),
    ]


def build() -> dict:
    role = names.POOL_ROLE.name
    variables = [
        query_variable("job", "Job", f"label_values({role}, job)"),
        query_variable("instance", "Instance",
                       f'label_values({role}{{job=~"$job"}}, instance)'),
    ]
    roles = table("Instances and their pools", "One row per agent: its pool role.",
                  Target(f"max by (instance, pool) ({role}{SEL})"))
    rows = [("Instances", [roles]), ("Engine state", _state_row()),
            ("Prefix cache", _prefix_cache_row()), ("KV tiers (host, disk)", _kv_tier_row()),
            ("Batches", _batch_row()),
            ("KV transfer (disaggregation)", _kv_transfer_row())]
    return dashboard(UID, "Slipstream / Instance internals", "Per-iteration engine behaviour "
                     "of each agent.", rows, variables)
