"""Policies side by side in the simulator, at several loads: Medha's evaluation, reproduced.

    workload (recipe or trace) x loads x policies --> simulate() --> summarize()
        --> OUT/<name>_results.json (settings, commit, a summary per load and policy),
            OUT/<name>_tables.md, OUT/<name>_ttft_cdf_q<load>.png,
            OUT/<name>_short_ttft_over_time.png (middle load)

The main table compares the systems Medha compares: FCFS as plain chunked prefill (no space
sharing, ``fcfs@0``) against EDF, LRS and Medha's LARS (``lars-classic``) with the packer's
defaults (space sharing 0.5), and Slipstream's LARS (``lars``, short lane and late reserve;
docs/scheduling.md). The secondary table runs the Medha policies with and without space
sharing, so the effect of the ordering alone is visible. Without ``--loads`` a trace is
replayed at its own rate. Examples::

    python -m slipstream.bench.sim_policies --name medha --recipe medha-mixed \
        --loads 0.4 0.8 1.2 --spp 2 --duration-s 1800 --horizon-s 2400 --out docs/img
    python -m slipstream.bench.sim_policies --name mooncake --trace mooncake \
        --loads 1.0 2.0 --spp 2 --long-prompt-tokens 32768 --out docs/img
    python -m slipstream.bench.sim_policies --name azure --trace azure --spp 1 --out docs/img
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.sim.cli import load_model
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.kv_capacity import estimate_kv_blocks
from slipstream.sim.plots import short_ttft_over_time, ttft_cdf
from slipstream.sim.report import summarize
from slipstream.sim.simulator import SimConfig, SimResult, simulate
from slipstream.sim.workloads import WorkloadSpec, build_workload

MAIN_POLICIES = ("fcfs@0", "edf", "lrs", "lars-classic", "lars")
SPACE_SHARING_POLICIES = ("fcfs@0", "fcfs@0.5", "edf@0", "edf@0.5", "lrs@0", "lrs@0.5",
                          "lars-classic@0", "lars-classic@0.5")


def scheduler_for(label: str) -> SchedulerConfig:
    name, _, share = label.partition("@")
    config = SchedulerConfig(policy=name)
    return replace(config, max_space_share_fraction=float(share)) if share else config


def row(label: str, summary: dict) -> str:
    short, long = summary["short"], summary["long"]
    return (f"| {label} | {short['ttft_s']['p50']:.3f} | {short['ttft_s']['p99']:.3f} | "
            f"{short['tpot_ms'].get('p50', float('nan')):.1f} | {summary['goodput_rps']:.3f} | "
            f"{summary['throughput_rps']:.3f} | {long['completed']}/{long['requests']} | "
            f"{long['ttft_s'].get('p50', float('nan')):.0f} | "
            f"{long['ttft_s'].get('p99', float('nan')):.0f} | "
            f"{summary['worst_long_delay_s'] or 0:.0f} |")


HEADER = ("| policy | short TTFT p50 (s) | short TTFT p99 (s) | short TPOT p50 (ms) | "
          "goodput (req/s) | throughput (req/s) | long done | long TTFT p50 (s) | "
          "long TTFT p99 (s) | worst long wait (s) |\n|---|---|---|---|---|---|---|---|---|---|")


def goals(summaries: dict) -> str:
    """Slipstream's LARS against the goals of its design (docs/scheduling.md), one line."""
    new, classic, fcfs = summaries["lars"], summaries["lars-classic"], summaries["fcfs@0"]
    best = max(summary["goodput_rps"] for summary in summaries.values())
    short_p99 = new["short"]["ttft_s"]["p99"] / classic["short"]["ttft_s"]["p99"]
    worst_long = (new["worst_long_delay_s"] or 0.0) / max(fcfs["worst_long_delay_s"] or 0.0, 1e-9)
    return (f"\nlars: goodput {new['goodput_rps'] / best:.3f}x the best (goal >= 0.98), "
            f"short p99 TTFT {short_p99:.2f}x lars-classic's (goal <= 1.2), "
            f"worst long wait {worst_long:.2f}x FCFS's (goal <= 1.5)")


def source_version() -> dict:
    """The commit these numbers come from, and whether the checkout had local changes, so
    that tables from different runs are not mixed by accident (None outside a git checkout)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True,
                                  text=True, check=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"),
            "local_changes": None if status is None else bool(status)}


# What every simulation of one run shares; set by main() before any worker is forked.
_RUN: dict = {}


def run_one(job: tuple[float | None, str]) -> tuple[SimResult, dict]:
    """Simulate one policy at one load (in a worker process when ``--jobs`` > 1)."""
    load, label = job
    args = _RUN["args"]
    config = SimConfig(scheduler=scheduler_for(label), instance=_RUN["instance"],
                       num_layers=_RUN["meta"].num_layers, horizon_s=args.horizon_s,
                       long_prompt_tokens=args.long_prompt_tokens)
    started = time.perf_counter()
    sim = simulate(_RUN["workloads"][load], config, _RUN["model"])
    summary = summarize(sim, args.long_prompt_tokens, args.slo_tpot_ms)
    print(f"q={load} {label}: {time.perf_counter() - started:.1f}s wall, short p99 TTFT "
          f"{summary['short']['ttft_s']['p99']:.3f}s", flush=True)
    return sim, summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="prefix of the output files")
    parser.add_argument("--recipe", default=None)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--loads", type=float, nargs="+", default=[None],
                        help="QPS values (default: a trace's own rate)")
    parser.add_argument("--duration-s", type=float, default=None)
    parser.add_argument("--horizon-s", type=float, default=None)
    parser.add_argument("--spp", type=int, default=2)
    parser.add_argument("--long-prompt-tokens", type=int, default=8192)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--secondary", action="store_true",
                        help="also run every policy with and without space sharing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1,
                        help="simulations run at once, one process each (results do not "
                             "depend on it: every simulation is deterministic)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, meta = load_model("h100-llama3-8b-tp8")
    instance = InstanceConfig(tp=meta.tp, spp=args.spp,
                              num_kv_blocks=estimate_kv_blocks(meta, meta.tp, args.spp, 1))
    # edf, lrs and lars-classic already run with the default share (0.5); @0.5 rows reuse them.
    aliases = {"edf@0.5": "edf", "lrs@0.5": "lrs", "lars-classic@0.5": "lars-classic"}
    policies = list(MAIN_POLICIES) + ([p for p in SPACE_SHARING_POLICIES
                                       if p not in MAIN_POLICIES and p not in aliases]
                                      if args.secondary else [])
    results: dict = {}
    version = source_version()
    tables = [f"# {args.name}: H100 Llama-3-8B TP{meta.tp}, SPP {args.spp}, one instance\n",
              f"Commit {version['commit']}"
              f"{' (with local changes)' if version['local_changes'] else ''}; the settings "
              f"are in {args.name}_results.json.\n"]
    middle = args.loads[len(args.loads) // 2]
    _RUN.update(args=args, model=model, meta=meta, instance=instance, workloads={
        load: build_workload(WorkloadSpec(trace=args.trace, recipe=args.recipe, qps=load,
                                          duration_s=args.duration_s, seed=args.seed))
        for load in args.loads})
    jobs = [(load, label) for load in args.loads for label in policies]
    if args.jobs > 1:  # worker processes inherit _RUN by fork
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool:
            outcomes = dict(zip(jobs, pool.map(run_one, jobs)))
    else:
        outcomes = dict(zip(jobs, map(run_one, jobs)))
    for load in args.loads:
        requests = _RUN["workloads"][load]
        rate = "own rate" if load is None else f"{load:g} QPS"
        tag = "native" if load is None else f"q{load:g}"
        sims = {label: outcomes[load, label][0] for label in policies}
        summaries = {label: outcomes[load, label][1] for label in policies}
        results["native" if load is None else str(load)] = summaries
        long_count = sum(r.prompt_tokens >= args.long_prompt_tokens for r in requests)
        tables.append(f"\n## {rate} ({len(requests)} requests, {long_count} long)\n\n{HEADER}")
        tables += [row(label, summaries[label]) for label in MAIN_POLICIES]
        tables.append(goals(summaries))
        if args.secondary:
            tables.append("\nWith and without space sharing (@F = max_space_share_fraction):\n")
            tables.append(HEADER)
            tables += [row(label, summaries[aliases.get(label, label)])
                       for label in SPACE_SHARING_POLICIES]
        main_sims = {label: sims[label] for label in MAIN_POLICIES}
        ttft_cdf(main_sims, args.out / f"{args.name}_ttft_cdf_{tag}.png",
                 args.long_prompt_tokens, f"{args.name}: TTFT CDF at {rate}")
        if load == middle:
            short_ttft_over_time(main_sims, args.out / f"{args.name}_short_ttft_over_time.png",
                                 args.long_prompt_tokens,
                                 f"{args.name}: short-request TTFT over time at {rate}")
    report = {"settings": {**{k: v for k, v in vars(args).items() if k not in ("out", "jobs")},
                           "source": version},
              "loads": results}
    (args.out / f"{args.name}_results.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{args.name}_tables.md").write_text("\n".join(tables) + "\n")
    print("\n".join(tables))


if __name__ == "__main__":
    main()
