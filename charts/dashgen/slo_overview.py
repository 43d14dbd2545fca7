"""The SLO overview dashboard: are requests meeting their TTFT and TPOT objectives, how much
goodput is there, and is the convoy effect (short requests waiting behind long prefills)
showing up?"""

from __future__ import annotations

from dashgen.grafana import Panel, Target, dashboard, query_variable, stat, timeseries
from dashgen.queries import (
    RATE, REQUEST_FILTER, in_pool, match, quantile, ratio_of_outcome, selector)
from slipstream.contracts import metric_names as names

UID = "slipstream-slo-overview"


def _objective_row() -> list[Panel]:
    counter = names.SLO_REQUESTS.name
    return [
        stat("TTFT attainment", "Share of finished requests that met their TTFT objective.",
             Target(ratio_of_outcome("ttft", "met", window="$__range")), unit="percentunit"),
        stat("TPOT attainment", "Share of finished requests that met their TPOT objective.",
             Target(ratio_of_outcome("tpot", "met", window="$__range")), unit="percentunit"),
        stat("Goodput", "Requests per second that met every objective they carried.",
             Target(f'sum (rate({counter}{{{REQUEST_FILTER}, slo="all", outcome="met"}}'
                    f"[{RATE}]))"), unit="reqps"),
        stat("Attainment target", "The ServingReplica's slo.attainmentTarget, as agents report "
             "it; the burn-rate alerts measure against it.",
             Target(f'max ({names.SLO_ATTAINMENT_TARGET.name}{{job=~"$job"}})'),
             unit="percentunit"),
    ]


def _latency_row() -> list[Panel]:
    ttft_target = f'max ({names.SLO_TTFT_TARGET.name}{{job=~"$job"}})'
    tpot_target = f'max ({names.SLO_TPOT_TARGET.name}{{job=~"$job"}})'
    return [
        timeseries("TTFT p50 / p99 against the objective", "Time to first token by request "
                   "class; the flat line is the default TTFT objective.",
                   Target(quantile(0.5, names.TTFT, "request_class"), "p50 {{request_class}}"),
                   Target(quantile(0.99, names.TTFT, "request_class"), "p99 {{request_class}}"),
                   Target(ttft_target, "objective"), unit="s"),
        timeseries("TPOT p50 / p99 against the objective", "Mean time per output token of each "
                   "request, by class; the flat line is the default TPOT objective.",
                   Target(quantile(0.5, names.TPOT, "request_class"), "p50 {{request_class}}"),
                   Target(quantile(0.99, names.TPOT, "request_class"), "p99 {{request_class}}"),
                   Target(tpot_target, "objective"), unit="s"),
        timeseries("Attainment by class", "Share of requests meeting each objective, per "
                   "request class.",
                   Target(ratio_of_outcome("ttft", "met", "request_class"),
                          "TTFT {{request_class}}"),
                   Target(ratio_of_outcome("tpot", "met", "request_class"),
                          "TPOT {{request_class}}"), unit="percentunit"),
        timeseries("Error budget burn rate", "Missed-objective ratio divided by the error budget "
                   "(1 - target). 1 spends the budget exactly over the SLO period; the page "
                   "fires above 14.4 (1h and 5m windows).",
                   *(Target(f"({ratio_of_outcome(slo, 'missed', window=window)}) / "
                            f'(1 - max ({names.SLO_ATTAINMENT_TARGET.name}{{job=~"$job"}}))',
                            f"{slo.upper()} {window}")
                     for slo in ("ttft", "tpot") for window in ("5m", "1h"))),
    ]


def _convoy_row() -> list[Panel]:
    in_flight = names.REQUESTS_IN_FLIGHT.name
    long_in_prefill = (f"sum ({in_flight}"
                       f'{selector(REQUEST_FILTER, match(request_class="long", phase="prefill"))})')
    prefill_tokens = in_pool(f"rate({names.PREFILL_CHUNK_TOKENS.name}_sum"
                             f'{{job=~"$job"}}[{RATE}])')
    return [
        timeseries("Convoy: short TTFT while long prefills run", "p99 TTFT of short requests "
                   "(left) next to the number of long requests still in prefill (bars, right). "
                   "Short TTFT that rises with the bars is the convoy effect.",
                   Target(quantile(0.99, names.TTFT, extra=match(request_class="short")),
                          "short TTFT p99"),
                   Target(long_in_prefill, "long requests in prefill"),
                   unit="s", right_axis=("long requests in prefill",)),
        timeseries("Requests waiting for their first token", "Accepted requests before their "
                   "first token (queued or prefilling), by class.",
                   Target(f"sum by (request_class) ({in_flight}"
                          f'{selector(REQUEST_FILTER, match(phase="prefill"))})',
                          "{{request_class}}")),
        timeseries("Prefill tokens per second", "Prompt tokens the engines prefill, per pool; "
                   "compare with the short TTFT above.",
                   Target(f"sum by (pool) ({prefill_tokens})", "{{pool}}"), unit="short"),
    ]


def _throughput_row() -> list[Panel]:
    request_filter = '{job=~"$job"}'
    return [
        timeseries("Finished requests by reason", "stop and length are served; abort means "
                   "the client left; error means the engine failed.",
                   Target(f"sum by (finish_reason) (rate({names.REQUESTS.name}{request_filter}"
                          f"[{RATE}]))", "{{finish_reason}}"), unit="reqps", width=8),
        timeseries("Tokens per second", "Prompt tokens of finished requests and tokens "
                   "generated.",
                   Target(f"sum (rate({names.PROMPT_TOKENS.name}{request_filter}[{RATE}]))",
                          "prompt"),
                   Target(f"sum (rate({names.GENERATION_TOKENS.name}{request_filter}"
                          f"[{RATE}]))", "generated"), width=8),
        timeseries("End-to-end latency p50 / p99", "Arrival to last token, by class.",
                   Target(quantile(0.5, names.E2E, "request_class"), "p50 {{request_class}}"),
                   Target(quantile(0.99, names.E2E, "request_class"), "p99 {{request_class}}"),
                   unit="s", width=8),
        timeseries("Inter-token latency p50 / p99", "Gap between streamed tokens, by class.",
                   Target(quantile(0.5, names.ITL, "request_class"), "p50 {{request_class}}"),
                   Target(quantile(0.99, names.ITL, "request_class"), "p99 {{request_class}}"),
                   unit="s", width=24),
    ]


def _tenant_row() -> list[Panel]:
    request_filter = '{job=~"$job"}'
    return [
        timeseries("Requests by tenant and outcome", "API requests per second at the agents, "
                   "by the API key's tenant (\"open\" without a tenants file, \"none\" before a "
                   "key was accepted) and outcome: refused keys, other tenants' app_ids and "
                   "rate limits show here.",
                   Target(f"sum by (tenant, outcome) (rate({names.TENANT_REQUESTS.name}"
                          f"{request_filter}[{RATE}]))", "{{tenant}} {{outcome}}"),
                   unit="reqps", width=12),
        timeseries("SLOs clamped to the tenant's tightest class", "Requests per second whose "
                   "slo asked for more than their tenant may have (a forged ttft_s, say), "
                   "scheduled at the tenant's tightest class instead.",
                   Target(f"sum by (tenant) (rate({names.TENANT_SLO_CLAMPED.name}"
                          f"{request_filter}[{RATE}]))", "{{tenant}}"),
                   unit="reqps", width=12),
    ]


def build() -> dict:
    role = names.POOL_ROLE.name
    variables = [
        query_variable("job", "Job", f"label_values({role}, job)"),
        query_variable("pool", "Pool", f'label_values({role}{{job=~"$job"}}, pool)'),
    ]
    rows = [("Objectives", _objective_row()), ("Latency against the objectives", _latency_row()),
            ("Convoy indicators", _convoy_row()), ("Throughput", _throughput_row()),
            ("Tenants", _tenant_row())]
    return dashboard(UID, "Slipstream / SLO overview", "TTFT and TPOT against their objectives, "
                     "goodput, attainment and convoy indicators.", rows, variables)
