"""Autoscaled against static fleets in the simulator: the study in docs/autoscaling.md.

    Azure 2023 conversation trace --warp_to_rate(daily curve | step)--> arrivals
      x {static at peak, static at mean, autoscaled (decide_scale)} --> simulate_fleet()
      --> OUT/autoscale_study.json, OUT/autoscale_study_tables.md, OUT/autoscale_study.png

Every fleet runs H100 Llama-3-8B TP8 instances (the packaged Vidur tables) under LARS, routed
by least backlog. The static sizes are found the way an operator would size them: the
smallest count whose SLO attainment reaches ``--size-for`` on a sizing run at the peak rate
(static at peak) or at the mean rate (static at mean). The autoscaled fleet starts at
``--min-instances`` and follows the CRD's defaults unless told otherwise; each ``--variant``
adds one more autoscaled fleet with some ``spec.autoscaling`` settings changed (say
``prefillLoad=0.75``), run on the same arrivals beside the default one. Every fleet first
serves a warm-up (``--warmup-s``, the curve's preceding stretch), neither billed nor counted,
so that the autoscaler starts the measured part with a history. Next to the fleets the
tables give a foresight bound: a model of the fewest instance-hours any autoscaler could
use at the knee (``foresight_bound``). Example::

    python -m slipstream.bench.autoscale_study --out results/autoscale
    python -m slipstream.bench.autoscale_study --out DIR --only daily \
        --variant prefillLoad=0.75
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.bench.autoscale_report import (AUTOSCALED, HEADER, LONG_PROMPT_TOKENS, plot,
                                               summary, table_row)
from slipstream.bench.autoscale_variants import parse_variant, variant_label
from slipstream.sim.autoscale import FleetResult, simulate_fleet
from slipstream.sim.cli import load_model
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.kv_capacity import estimate_kv_blocks
from slipstream.sim.report import meets_slo
from slipstream.sim.simulator import SimConfig
from slipstream.sim.traces import (
    RateCurve, TraceRequest, diurnal_rate, merge_streams, step_rate, warp_to_rate)
from slipstream.sim.workloads import WorkloadSpec, build_workload
from slipstream.crds.servingreplica import ServingReplicaSpec

DAY_S = 1800.0  # the compressed day (docs/autoscaling.md: why, and what it does to windows)
TAIL_S = 120.0  # after the last arrival, for requests to finish (not billed)
# Before the measured part, the fleets serve the curve's preceding stretch (the end of the
# previous day; the low rate before a step), unbilled and unmeasured: an operator that has
# been running has a history, so the autoscaler's forecast and windows start warm.
WARMUP_S = 180.0
FORESIGHT_WINDOW_S = 30.0  # the load window of the foresight bound (the agents' window)


# What every simulation needs, set in main() before the worker processes fork (so that each
# inherits it rather than loading the tables and the trace again).
_SHARED: dict = {}


def autoscaled_spec(args: argparse.Namespace, overlay: dict | None = None
                    ) -> ServingReplicaSpec:
    """The autoscaled fleet's replica: the CRD's defaults with the study's bounds and
    scale-down window, and ``overlay`` (a ``--variant``) on top."""
    overlay = overlay or {}
    autoscaling = {"minInstances": args.min_instances, "maxInstances": args.max_instances,
                   "scaleDownStabilizationSeconds": args.scale_down_window_s,
                   **{k: v for k, v in overlay.items() if k != "targets"}}
    if "targets" in overlay:
        autoscaling["targets"] = dict(overlay["targets"])
    return ServingReplicaSpec.model_validate({
        "model": {"name": "llama-3-8b", "source": {"hostPath": {"path": "/models"}}},
        "image": "agent", "slo": {"tpotMilliseconds": args.tpot_slo_ms},
        "autoscaling": autoscaling})


def autoscaling_settings(args: argparse.Namespace, overlay: dict | None = None) -> dict | None:
    """Every ``spec.autoscaling`` setting the fleet runs with, as the CRD writes them."""
    autoscaling = autoscaled_spec(args, overlay).autoscaling
    return autoscaling.to_api() if autoscaling else None


def workloads(args: argparse.Namespace, trace: list[TraceRequest]
              ) -> dict[str, tuple[RateCurve, float, dict]]:
    day = diurnal_rate(args.trough_qps, args.peak_qps, args.day_s)
    step = step_rate(args.step_low_qps, args.step_high_qps, args.step_s / 4, 3 * args.step_s / 4)
    return {
        "daily": (day, args.day_s, {"curve": "raised cosine", "trough_qps": args.trough_qps,
                                    "peak_qps": args.peak_qps, "day_s": args.day_s}),
        "step": (step, args.step_s, {"curve": "step", "low_qps": args.step_low_qps,
                                     "high_qps": args.step_high_qps,
                                     "up_at_s": args.step_s / 4, "down_at_s": 3 * args.step_s / 4}),
    }


def attainment(result: FleetResult, tpot_slo_ms: float) -> float:
    records = result.records
    return sum(meets_slo(r, tpot_slo_ms) for r in records) / max(1, len(records))


def sizing_run(qps: float, count: int, args: argparse.Namespace) -> float:
    """SLO attainment of ``count`` static instances on a steady ``qps`` (a worker's task)."""
    requests = warp_to_rate(_SHARED["trace"], lambda t: np.full_like(t, qps), args.sizing_s)
    config = replace(_SHARED["base"], horizon_s=args.sizing_s + TAIL_S)
    result = simulate_fleet(requests, config, _SHARED["model"], instances=count,
                            tpot_slo_s=args.tpot_slo_ms / 1000.0)
    reached = attainment(result, args.tpot_slo_ms)
    print(f"  sizing at {qps:.1f} QPS: {count} instance(s) -> {reached:.4f}", flush=True)
    return reached


def size_static(pool: ProcessPoolExecutor, rates: list[float], args: argparse.Namespace
                ) -> dict[float, tuple[int, list[dict]]]:
    """For each rate, the smallest static count reaching ``--size-for`` on a steady run. The
    first guess, ``ceil(qps / --sizing-qps-per-instance)`` (the measured knee), and one fewer
    run at once; usually that settles it (the guess reaches, one fewer does not). Otherwise
    it goes on one count at a time, down while counts reach, up while they fall short (to
    ``--max-instances`` at most)."""
    tried: dict[float, dict[int, float]] = {qps: {} for qps in rates}
    pending: dict[tuple[float, int], Future] = {}

    def submit(qps: float, count: int) -> None:
        if count not in tried[qps] and (qps, count) not in pending:
            pending[(qps, count)] = pool.submit(sizing_run, qps, count, args)

    def answer(qps: float) -> int | None:
        seen = tried[qps]
        passing = [c for c, value in seen.items() if value >= args.size_for]
        best = min(passing, default=None)
        if best is not None and (best == 1 or seen.get(best - 1, 1.0) < args.size_for):
            return best
        if best is None and args.max_instances in seen:
            return args.max_instances  # nothing reaches it: the most there may be
        return None

    for qps in rates:
        guess = min(args.max_instances, max(1, math.ceil(qps / args.sizing_qps_per_instance)))
        submit(qps, guess)
        if guess > 1:
            submit(qps, guess - 1)
    while pending:
        for key, run in list(pending.items()):
            if run.done():
                tried[key[0]][key[1]] = run.result()
                del pending[key]
        for qps in rates:
            seen = tried[qps]
            if answer(qps) is not None or any(q == qps for q, _ in pending):
                continue
            passing = [c for c, value in seen.items() if value >= args.size_for]
            submit(qps, min(passing) - 1 if passing else max(seen) + 1)
        if pending:
            time.sleep(0.2)
    return {qps: (answer(qps) or args.max_instances,
                  [{"instances": c, "slo_attainment": v} for c, v in sorted(tried[qps].items())])
            for qps in rates}


def arrivals(workload: str, args: argparse.Namespace) -> tuple[list[TraceRequest], float]:
    """The workload's requests, the warm-up (``--warmup-s``) first; and the day's length."""
    rate, duration_s, _ = workloads(args, _SHARED["trace"])[workload]
    warmup = args.warmup_s
    return warp_to_rate(_SHARED["trace"], lambda t: rate(t - warmup), warmup + duration_s), \
        duration_s


def foresight_bound(requests: list[TraceRequest], start_s: float, duration_s: float,
                    args: argparse.Namespace) -> float:
    """Instance-seconds of a fleet that knows the future: every second it runs the instances
    the prompt tokens of the trailing 30 s need at ``--sizing-qps-per-instance`` requests of
    the trace's mean prompt per second each (the knee), starts each ``--startup-s`` before
    it is needed (billed), and stops it as soon as nothing needs it within a startup. No
    causal autoscaler does better at that knee; the model ignores queueing and decode."""
    arrival = np.fromiter((r.arrival_s for r in requests), dtype=np.float64, count=len(requests))
    tokens = np.concatenate(([0.0], np.cumsum(
        np.fromiter((r.prompt_tokens for r in requests), dtype=np.float64,
                    count=len(requests)))))
    grid = np.arange(start_s, start_s + duration_s, 1.0)
    work = (tokens[np.searchsorted(arrival, grid, side="right")]
            - tokens[np.searchsorted(arrival, grid - FORESIGHT_WINDOW_S, side="right")]
            ) / FORESIGHT_WINDOW_S
    trace = _SHARED["trace"]
    capacity = args.sizing_qps_per_instance * sum(r.prompt_tokens for r in trace) / len(trace)
    need = np.maximum(args.min_instances, np.ceil(work / capacity - 1e-9))
    ahead = int(round(args.startup_s))
    padded = np.concatenate((need, np.full(ahead, need[-1])))
    have = np.lib.stride_tricks.sliding_window_view(padded, ahead + 1).max(axis=1)
    return float(have.sum())


def run_fleet(workload: str, label: str, count: int, autoscaled: bool,
              args: argparse.Namespace, overlay: dict | None = None) -> dict:
    """One fleet on one workload (in a worker process): its summary. An autoscaled fleet
    runs ``autoscaled_spec(args, overlay)``."""
    requests, duration_s = arrivals(workload, args)
    warmup = args.warmup_s
    config = replace(_SHARED["base"], horizon_s=warmup + duration_s + TAIL_S)
    started = time.perf_counter()
    result = simulate_fleet(requests, config, _SHARED["model"], instances=count,
                            spec=autoscaled_spec(args, overlay) if autoscaled else None,
                            startup_s=args.startup_s, bill_from_s=warmup,
                            bill_until_s=warmup + duration_s,
                            tpot_slo_s=args.tpot_slo_ms / 1000.0)
    item = summary(label, result, args)
    if autoscaled:
        item["autoscaling"] = autoscaling_settings(args, overlay)
    print(f"{workload} {label}: {item['instance_hours']:.2f} instance-h, attainment "
          f"{item['slo_attainment']:.4f}, short p99 {item['short_ttft_p99_s']:.3f} s, "
          f"{time.perf_counter() - started:.0f} s wall", flush=True)
    return item


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--day-s", type=float, default=DAY_S,
                        help="length of the compressed day: a 24-hour curve played over this "
                        f"many seconds (default {DAY_S:.0f})")
    parser.add_argument("--trough-qps", type=float, default=16.0)
    parser.add_argument("--peak-qps", type=float, default=64.0)
    parser.add_argument("--step-s", type=float, default=400.0,
                        help="length of the step workload: low for the first quarter, high "
                        "for the middle half, low again")
    parser.add_argument("--step-low-qps", type=float, default=16.0,
                        help="the step's low rate (default the day's trough)")
    parser.add_argument("--step-high-qps", type=float, default=40.0,
                        help="the step's high rate (default the day's mean, so the static "
                        "sizing at that rate is shared)")
    parser.add_argument("--scale-down-window-s", type=int, default=60,
                        help="spec.autoscaling.scaleDownStabilizationSeconds (the CRD default "
                        "is 300 s against a real day; docs/autoscaling.md says why the "
                        "compressed day uses less)")
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--size-for", type=float, default=0.99,
                        help="SLO attainment a static fleet is sized to reach")
    parser.add_argument("--sizing-s", type=float, default=120.0)
    parser.add_argument("--sizing-qps-per-instance", type=float, default=27.0,
                        help="sizing starts at ceil(rate / this) (the measured knee) and "
                        "counts down until a count falls short, or up if the first does")
    parser.add_argument("--min-instances", type=int, default=1)
    parser.add_argument("--max-instances", type=int, default=8)
    parser.add_argument("--startup-s", type=float, default=60.0,
                        help="decision to serving for a new instance")
    parser.add_argument("--warmup-s", type=float, default=WARMUP_S,
                        help="seconds served before the measured part (the curve's preceding "
                        "stretch), neither billed nor counted, so that the autoscaler starts "
                        f"with a history as a running operator does (default {WARMUP_S:.0f})")
    parser.add_argument("--streams", type=int, default=1,
                        help="copies of the trace played side by side, each a fraction of its "
                        "hour apart, before the warp (sim/traces.py: merge_streams): a "
                        "population that many times the trace's, each part at the trace's "
                        "own pace (default 1: the trace alone, replayed faster; 0: the day's "
                        "mean rate over the trace's, rounded; docs/autoscaling.md)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="one more autoscaled fleet, beside the default one and on the same "
                        "arrivals, with these spec.autoscaling settings changed (CRD names; "
                        "targets bare or as targets.NAME), e.g. prefillLoad=0.75 or "
                        "'prefillLoad=0.75,tolerance=0.05'; repeat for several fleets")
    parser.add_argument("--only", choices=("daily", "step"), default=None)
    parser.add_argument("--jobs", type=int, default=1,
                        help="simulations run at once, one process each (the figures do not "
                        "change; the Makefile passes SIM_JOBS)")
    args = parser.parse_args(argv)
    variants: dict[str, dict] = {}
    for text in args.variant:
        try:
            overlay = parse_variant(text)
            autoscaled_spec(args, overlay)
        except ValueError as error:  # pydantic's ValidationError is one
            parser.error(f"--variant {text!r}: {error}")
        if variant_label(overlay) in variants or not overlay:
            parser.error(f"--variant {text!r}: the same settings as another fleet")
        variants[variant_label(overlay)] = overlay
    args.out.mkdir(parents=True, exist_ok=True)
    wall_started = time.perf_counter()
    model, meta = load_model("h100-llama3-8b-tp8")
    instance = InstanceConfig(tp=meta.tp, num_kv_blocks=estimate_kv_blocks(meta, meta.tp, 1, 1))
    recorded = build_workload(WorkloadSpec(trace="azure"))
    recorded_qps = (len(recorded) - 1) / (recorded[-1].arrival_s - recorded[0].arrival_s)
    if args.streams <= 0:
        args.streams = max(1, round((args.trough_qps + args.peak_qps) / 2 / recorded_qps))
    _SHARED.update(model=model, trace=merge_streams(recorded, args.streams),
                   base=SimConfig(scheduler=SchedulerConfig(), instance=instance,
                                  num_layers=meta.num_layers,
                                  long_prompt_tokens=LONG_PROMPT_TOKENS))
    shapes = {name: value for name, value in workloads(args, _SHARED["trace"]).items()
              if not args.only or name == args.only}
    rates: dict[str, tuple[float, float]] = {}
    for name, (rate, duration_s, _) in shapes.items():
        grid = np.arange(0.0, duration_s, 1.0)
        rates[name] = (float(rate(grid).max()), float(rate(grid).mean()))
    # Everything that does not wait on a sizing result starts at once: the sizing runs (one
    # search per distinct rate) and the autoscaled fleets; the static fleets follow as their
    # sizes come in.
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=context) as pool:
        fleets: dict[tuple[str, str], Future] = {
            (name, label): pool.submit(run_fleet, name, label, args.min_instances, True, args,
                                       overlay)
            for name in shapes for label, overlay in {AUTOSCALED: {}, **variants}.items()}
        sizes = size_static(pool, sorted({q for pair in rates.values() for q in pair}), args)
        by_count: dict[tuple[str, int], Future] = {}
        for name, (peak_qps, mean_qps) in rates.items():
            for label, qps in (("static-peak", peak_qps), ("static-mean", mean_qps)):
                # Two static fleets of one size on one workload are one simulation.
                key = (name, sizes[qps][0])
                if key not in by_count:
                    by_count[key] = pool.submit(run_fleet, name, label, key[1], False, args)
                fleets[(name, label)] = by_count[key]
        done = {key: {**run.result(), "label": key[1]} for key, run in fleets.items()}
    tables = [f"Autoscaling study: H100 Llama-3-8B TP8 instances (Vidur tables), LARS, "
              f"TPOT SLO {args.tpot_slo_ms:.0f} ms, TTFT deadline the scheduler's default; "
              f"new instances serve {args.startup_s:.0f} s after the decision; static fleets "
              f"sized for {args.size_for:.2%} attainment; the Azure conversation trace "
              f"({recorded_qps:.2f} req/s) as {args.streams} streams side by side; a "
              f"{args.warmup_s:.0f} s warm-up before each workload.\n"]
    results: dict[str, dict[str, dict]] = {}
    sizing: dict[str, dict] = {}
    for name, (_, duration_s, shape) in shapes.items():
        peak_qps, mean_qps = rates[name]
        (peak_n, peak_tried), (mean_n, mean_tried) = sizes[peak_qps], sizes[mean_qps]
        summaries = {label: done[(name, label)]
                     for label in ("static-peak", "static-mean", AUTOSCALED, *variants)}
        requests = summaries[AUTOSCALED]["requests"]
        sizing[name] = {"peak_qps": peak_qps, "mean_qps": mean_qps, "static_peak": peak_n,
                        "static_mean": mean_n, "tried_peak": peak_tried,
                        "tried_mean": mean_tried, "shape": shape, "requests": requests}
        results[name] = summaries
        peak_hours = summaries["static-peak"]["instance_hours"]
        tables.append(f"\n### {name}: {requests} requests, mean {mean_qps:.1f} QPS, peak "
                      f"{peak_qps:.1f} QPS; static sizes {peak_n} (peak), {mean_n} (mean)\n\n"
                      f"{HEADER}")
        tables += [table_row(item, peak_hours) for item in summaries.values()]
        requests_in, day_s = arrivals(name, args)
        bound = foresight_bound(requests_in, args.warmup_s, day_s, args) / 3600.0
        sizing[name]["foresight_bound_instance_hours"] = bound
        tables.append(
            f"\nForesight bound (a model, not a simulation; docs/autoscaling.md): "
            f"{bound:.2f} instance-h ({bound / peak_hours - 1:+.1%} vs static at peak).")
    wall_s = time.perf_counter() - wall_started
    tables.append(f"\n{wall_s / 60:.1f} minutes of wall time with --jobs {args.jobs}.")
    (args.out / "autoscale_study.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()},
         "autoscaling": autoscaling_settings(args),
         "variants": {label: autoscaling_settings(args, overlay)
                      for label, overlay in variants.items()},
         "sizing": sizing, "results": results, "wall_s": wall_s}, indent=1) + "\n")
    (args.out / "autoscale_study_tables.md").write_text("\n".join(tables) + "\n")
    plot(results, args.out / "autoscale_study.png")
    print("\n".join(tables))


if __name__ == "__main__":
    main()
