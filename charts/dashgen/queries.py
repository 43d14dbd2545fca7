"""PromQL fragments shared by the dashboards, written against ``metric_names`` so that a renamed
metric breaks generation here instead of leaving an empty panel in Grafana.

Grafana substitutes ``$job``, ``$pool``, ``$instance`` (template variables, regexes with All =
``.*``) and ``$__rate_interval`` before a query reaches Prometheus.
"""

from __future__ import annotations

from slipstream.contracts import metric_names as names

RATE = "$__rate_interval"
REQUEST_FILTER = 'job=~"$job", pool=~"$pool"'
INSTANCE_FILTER = 'job=~"$job", instance=~"$instance"'
TARGET_KEY = "namespace, job, instance"  # what identifies one scraped agent


def name(spec: names.MetricSpec, suffix: str = "") -> str:
    """The series name of ``spec`` (``_bucket``/``_sum``/``_count`` only on histograms)."""
    if suffix:
        assert spec.type == "histogram", f"{spec.name} is a {spec.type}, not a histogram"
    return spec.name + suffix


def selector(labels: str, extra: str = "") -> str:
    return "{" + ", ".join(part for part in (labels, extra) if part) + "}"


def quantile(q: float, spec: names.MetricSpec, by: str = "", labels: str = REQUEST_FILTER,
             extra: str = "") -> str:
    group = ", ".join(part for part in ("le", by) if part)
    return (f"histogram_quantile({q}, sum by ({group}) "
            f"(rate({name(spec, '_bucket')}{selector(labels, extra)}[{RATE}])))")


def mean(spec: names.MetricSpec, by: str = "", labels: str = REQUEST_FILTER,
         extra: str = "") -> str:
    sel = selector(labels, extra)
    group = f" by ({by})" if by else ""
    return (f"sum{group} (rate({name(spec, '_sum')}{sel}[{RATE}])) / "
            f"sum{group} (rate({name(spec, '_count')}{sel}[{RATE}]))")


def ratio_of_outcome(slo: str, outcome: str, by: str = "", window: str = RATE) -> str:
    """Share of finished requests whose ``slo`` objective had ``outcome`` (met or missed)."""
    counter = names.SLO_REQUESTS.name
    group = f" by ({by})" if by else ""
    return (f'sum{group} (rate({counter}{{{REQUEST_FILTER}, slo="{slo}", outcome="{outcome}"}}'
            f'[{window}])) / sum{group} (rate({counter}{{{REQUEST_FILTER}, slo="{slo}"}}'
            f'[{window}]))')


def in_pool(expr: str) -> str:
    """Attach the pool label to a per-agent series (engine gauges carry none) and filter it."""
    return (f"({expr}) * on ({TARGET_KEY}) group_left (pool) "
            f'{names.POOL_ROLE.name}{{job=~"$job", pool=~"$pool"}}')


def match(**labels: str) -> str:
    """Equality matchers: ``match(phase="prefill")`` -> ``phase="prefill"``."""
    return ", ".join(f'{label}="{value}"' for label, value in labels.items())
