"""The autoscaling study's report: per-fleet summaries, the p99 series, the plot and the
tables (``autoscale_study.py`` runs the fleets; docs/autoscaling.md shows the results)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from slipstream.sim.autoscale import FleetResult
from slipstream.sim.report import summarize, ttft_s
from slipstream.sim.simulator import SimResult

LONG_PROMPT_TOKENS = 8192
PLOT_BIN_S = 30.0
AUTOSCALED = "autoscaled"  # the label of the autoscaled fleet with the study's settings


def summary(label: str, result: FleetResult, args: argparse.Namespace) -> dict:
    """The measured part only: requests arriving after the warm-up, times from its end."""
    warmup = args.warmup_s
    records = [r for r in result.records if r.arrival_s >= warmup]
    sim = SimResult(policy="lars", records=records, end_s=result.end_s,
                    num_iterations=0, wall_s=result.wall_s, busy_s=[],
                    horizon_s=result.end_s)
    report = summarize(sim, LONG_PROMPT_TOKENS, args.tpot_slo_ms)
    events = [{**e, "time_s": e["time_s"] - warmup} for e in result.decisions]
    return {
        "label": label,
        "instance_hours": result.instance_seconds / 3600.0,
        "slo_attainment": report["overall"]["slo_attainment"],
        "short_ttft_p99_s": report["short"]["ttft_s"].get("p99"),
        "long_ttft_p99_s": report["long"]["ttft_s"].get("p99"),
        "long_requests": report["long"]["requests"],
        "ttft_p99_s": report["overall"]["ttft_s"].get("p99"),
        "requests": report["requests"], "unfinished": report["unfinished"],
        "wall_s": result.wall_s,
        "scale_events": [e for e in events if e["time_s"] >= 0],
        "warmup_scale_events": [e for e in events if e["time_s"] < 0],
        "timeline": [{**p, "time_s": p["time_s"] - warmup} for p in result.timeline
                     if p["time_s"] >= warmup],
        "series": p99_series(result, warmup),
    }


def p99_series(result: FleetResult, warmup_s: float = 0.0) -> list[dict]:
    """p99 TTFT (and arrivals) of the requests arriving in each 30 s bin after the warm-up."""
    bins: dict[int, list[float]] = {}
    for record in result.records:
        if record.arrival_s < warmup_s:
            continue
        value = ttft_s(record)
        bins.setdefault(int((record.arrival_s - warmup_s) // PLOT_BIN_S), []).append(
            value if value is not None else result.end_s - record.arrival_s)
    return [{"time_s": k * PLOT_BIN_S, "arrival_qps": len(v) / PLOT_BIN_S,
             "ttft_p99_s": float(np.percentile(v, 99))} for k, v in sorted(bins.items())]


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(3, len(results), figsize=(7 * len(results), 9), sharex="col",
                                squeeze=False)
    colours = {"static-peak": "#37a", "static-mean": "#888", AUTOSCALED: "#d72"}
    extra = iter(["#2a2", "#a2a", "#c90", "#0aa", "#e48", "#555"] * 4)  # the --variant fleets
    for column, (workload, summaries) in enumerate(results.items()):
        load_axis, count_axis, ttft_axis = axes[:, column]
        series = summaries[AUTOSCALED]["series"]
        load_axis.plot([p["time_s"] / 60 for p in series], [p["arrival_qps"] for p in series],
                       color="k")
        load_axis.set_ylabel("arrivals (req/s)")
        load_axis.set_title(f"{workload}: load, instances, p99 TTFT per 30 s")
        for label, item in summaries.items():
            if label not in colours:
                colours[label] = next(extra)
            timeline = item["timeline"]
            count_axis.step([p["time_s"] / 60 for p in timeline],
                            [p["instances"] for p in timeline], where="post",
                            color=colours[label], label=f"{label} "
                            f"({item['instance_hours']:.2f} instance-h)")
            ttft_axis.plot([p["time_s"] / 60 for p in item["series"]],
                           [p["ttft_p99_s"] for p in item["series"]], color=colours[label],
                           label=f"{label} (attainment {item['slo_attainment']:.3f})")
        count_axis.set_ylabel("instances")
        count_axis.legend(fontsize=8)
        ttft_axis.set_ylabel("p99 TTFT (s)")
        ttft_axis.set_yscale("log")
        ttft_axis.set_xlabel("time (min)")
        ttft_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


HEADER = ("| fleet | instance-hours | vs static at peak | SLO attainment | short p99 TTFT (s) | "
          "long p99 TTFT (s) | scale events |\n|---|---|---|---|---|---|---|")


def table_row(item: dict, peak_hours: float) -> str:
    long_p99 = item["long_ttft_p99_s"]
    return (f"| {item['label']} | {item['instance_hours']:.2f} | "
            f"{item['instance_hours'] / peak_hours - 1:+.1%} | {item['slo_attainment']:.4f} | "
            f"{item['short_ttft_p99_s']:.3f} | "
            f"{'-' if long_p99 is None else f'{long_p99:.2f}'} ({item['long_requests']} long) | "
            f"{len(item['scale_events'])} |")
