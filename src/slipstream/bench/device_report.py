"""What ``make device-check`` (device_check.py) reports: each goal of the GPU engine issue
judged from the run's figures, a summary the device tool's reply shows last, and the plot.

    device_check.json's report --goals()--> rows (value, target, met or not measured)
                               --summary()--> text      --plot()--> device_check.png
"""

from __future__ import annotations

from pathlib import Path


def goals(report: dict) -> list[dict]:
    """Each goal of the issue: measured value, target, met (None when not measured)."""
    serving_result = report.get("stages", {}).get("serving", {})
    environment_result = report.get("stages", {}).get("environment", {})
    rows = []

    def add(name: str, value, target: str, met) -> None:
        rows.append({"goal": name, "value": value, "target": target,
                     "met": None if value is None else bool(met)})

    one = serving_result.get("streams_1", {})
    bandwidth = environment_result.get("copy_gb_per_s")
    weights = serving_result.get("weight_bytes")
    read_ms = weights / (bandwidth * 1e9) * 1000 if weights and bandwidth else None
    tpot = one.get("tpot_p50_ms")
    ratio = tpot / read_ms if tpot and read_ms else None
    add("batch-1 TPOT / weight-read time", None if ratio is None else round(ratio, 2),
        f"<= 1.5 (weight read {read_ms:.2f} ms)" if read_ms else "<= 1.5", (ratio or 9) <= 1.5)
    quantized_tpot = serving_result.get("quantized_streams_1", {}).get("tpot_p50_ms")
    weights = serving_result.get("quantized", {}).get("weights", "quantized")
    speedup = quantized_tpot / tpot if quantized_tpot and tpot else None
    add(f"batch-1 TPOT, {weights} / {report.get('dtype', 'float')}",
        None if speedup is None else round(speedup, 2), "<= 0.6", (speedup or 9) <= 0.6)
    wide = serving_result.get(f"streams_{max(report.get('scale_streams', [256]))}", {})
    add("most streams: output tok/s", wide.get("output_tok_per_s"), ">= 8000",
        (wide.get("output_tok_per_s") or 0) >= 8000)
    add("most streams: TTFT p50 s", wide.get("ttft_p50_s"), "<= 2",
        (wide.get("ttft_p50_s") or 99) <= 2)
    long = serving_result.get("long_prompt", {})
    add("long prompt alone: TTFT s", long.get("ttft_s"), "<= 10", (long.get("ttft_s") or 99) <= 10)
    lars, fcfs = serving_result.get("convoy_lars", {}), serving_result.get("convoy_fcfs", {})
    everything = [c for c in (lars, fcfs) if "short_sent" in c]
    complete = all(c["short_completed"] == c["short_sent"]
                   and c["documents_completed"] == c["documents_sent"] for c in everything)
    add("convoy: every request completes", complete if everything else None, "all", complete)
    lars_p99, fcfs_p99 = lars.get("short_ttft_p99_s"), fcfs.get("short_ttft_p99_s")
    add("convoy: LARS short TTFT p99 s", lars_p99, "<= 0.5", (lars_p99 or 99) <= 0.5)
    gain = fcfs_p99 / lars_p99 if lars_p99 and fcfs_p99 else None
    add("convoy: FCFS p99 / LARS p99", None if gain is None else round(gain, 1), ">= 10",
        (gain or 0) >= 10)
    return rows


def summary(report: dict) -> str:
    lines = [f"device check on {report['stages'].get('environment', {}).get('chip', '?')}"
             f"{' (CPU rehearsal)' if report['rehearsal'] else ''}, "
             f"{report.get('duration_s', 0):.0f} s"]
    for name in ("gpu_tests", "engine_tier"):
        stage = report["stages"].get(name)
        if stage:
            lines.append(f"  {name}: " + ", ".join(
                f"{key} {stage[key]}" for key in ("passed", "failed", "skipped", "timed_out",
                                                  "skipped_stage") if key in stage))
    serving_result = report["stages"].get("serving", {})
    for key, value in serving_result.items():
        if key.startswith("streams_") and isinstance(value, dict):
            lines.append(f"  {key}: {_fmt(value.get('output_tok_per_s'))} tok/s, TPOT p50 "
                         f"{_fmt(value.get('tpot_p50_ms'))} ms, TTFT p50 "
                         f"{_fmt(value.get('ttft_p50_s'))} s {value.get('error', '')}")
    for row in report.get("goals", []):
        mark = {True: "met", False: "MISSED", None: "not measured"}[row["met"]]
        lines.append(f"  goal {row['goal']}: {row['value']} (target {row['target']}): {mark}")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    serving_result = report["stages"].get("serving", {})
    rows = [v for k, v in serving_result.items()
            if k.startswith("streams_") and isinstance(v, dict) and "streams" in v]
    figure, ((rate, latency), (timeline, table)) = plt.subplots(2, 2, figsize=(13, 9))
    labels = [str(r["streams"]) for r in rows]
    rate.bar(labels, [r["output_tok_per_s"] for r in rows], color="tab:blue")
    rate.set_xlabel("concurrent streams")
    rate.set_ylabel("output tokens / s")
    rate.set_title("throughput")
    latency.plot(labels, [r.get("tpot_p50_ms") or 0 for r in rows], "o-", label="TPOT p50 (ms)")
    latency.plot(labels, [1000 * (r.get("ttft_p50_s") or 0) for r in rows], "s-",
                 label="TTFT p50 (ms)")
    latency.set_yscale("log")
    latency.set_xlabel("concurrent streams")
    latency.legend()
    latency.set_title("latency")
    for name, color in (("convoy_lars", "tab:green"), ("convoy_fcfs", "tab:red")):
        points = serving_result.get(name, {}).get("short_ttft_s") or []
        if points:
            timeline.scatter([a for a, _ in points], [t for _, t in points], s=8, color=color,
                             label=name.split("_")[1].upper())
    timeline.set_xlabel("arrival (s)")
    timeline.set_ylabel("short request TTFT (s)")
    timeline.set_title("convoy: short requests among long documents")
    if timeline.collections:
        timeline.set_yscale("log")
        timeline.legend()
    else:
        timeline.text(0.5, 0.5, "not measured", ha="center", va="center",
                      transform=timeline.transAxes)
    table.axis("off")
    cells = [[row["goal"], _fmt(row["value"]), row["target"],
              {True: "met", False: "missed", None: "-"}[row["met"]]]
             for row in report.get("goals", [])]
    if cells:
        shown = table.table(cellText=cells, colLabels=["goal", "value", "target", ""],
                            loc="center", cellLoc="left", colWidths=[0.42, 0.14, 0.32, 0.12])
        shown.auto_set_font_size(False)
        shown.set_fontsize(8)
        shown.scale(1, 1.4)
    chip = report["stages"].get("environment", {}).get("chip", "?")
    figure.suptitle(f"make device-check on {chip}"
                    f"{' (CPU rehearsal: small model, not the goals)' if report['rehearsal'] else ''}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
