"""Length-aware pools against one unified pool, with the same GPUs: the study in docs/pools.md.

    workload (Mooncake trace, medha-mixed) x configurations --> simulate() --> summarize()
        --> OUT/pools_study.json, OUT/pools_study_tables.md, OUT/pools_study.png

Configurations, all on the same ``--num-instances`` H100 Llama-3-8B TP8 instances:
- ``unified-fcfs``, ``unified-lars``: one least-backlog router over every instance;
- ``static-fcfs``, ``static-lars``: short/long pools by prompt length, fixed split;
- ``rebalanced-fcfs``, ``rebalanced-lars``: the same pools, the operator's PLA-Serve
  rebalancer moving at most one instance per cooldown.

"fcfs" is plain chunked prefill (``max_space_share_fraction=0``), PLA-Serve's baseline engine;
"lars" is LARS with the packer defaults. The static split (also the rebalanced start) gives
the short pool its share of the workload's prompt tokens, rounded, at least one instance per
pool: the split an operator would pick from the token mix. Example::

    python -m slipstream.bench.pools_study --num-instances 4 --out docs/img
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.sim.cli import load_model
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.kv_capacity import estimate_kv_blocks
from slipstream.sim.pools import PoolsConfig
from slipstream.sim.report import summarize
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.traces import TraceRequest
from slipstream.sim.workloads import WorkloadSpec, build_workload
from slipstream.crds.servingreplica import Rebalance

CONFIGS = ("unified-fcfs", "unified-lars", "static-fcfs", "static-lars", "rebalanced-fcfs",
           "rebalanced-lars")


@dataclass(frozen=True)
class StudyWorkload:
    name: str
    spec: WorkloadSpec
    long_threshold_tokens: int


def workloads(args: argparse.Namespace) -> list[StudyWorkload]:
    return [
        StudyWorkload("mooncake", WorkloadSpec(trace="mooncake", qps=args.mooncake_qps,
                                               duration_s=args.duration_s, seed=args.seed),
                      32_768),
        StudyWorkload("medha-mixed", WorkloadSpec(recipe="medha-mixed", qps=args.medha_qps,
                                                  duration_s=args.duration_s, seed=args.seed),
                      8192),
    ]


def short_split(requests: list[TraceRequest], threshold: int, num_instances: int) -> int:
    """Short-pool size from the short requests' share of prompt tokens, 1..n-1."""
    total = sum(r.prompt_tokens for r in requests) or 1
    short = sum(r.prompt_tokens for r in requests if r.prompt_tokens < threshold)
    return min(num_instances - 1, max(1, round(num_instances * short / total)))


def sim_config(label: str, base: SimConfig, short: int, threshold: int,
               rebalance: Rebalance) -> SimConfig:
    layout, _, policy = label.partition("-")
    share = 0.0 if policy == "fcfs" else 0.5
    scheduler = SchedulerConfig(policy=policy, max_space_share_fraction=share)
    pools = None if layout == "unified" else PoolsConfig(
        mode=layout, short_instances=short, long_threshold_tokens=threshold, rebalance=rebalance)
    return replace(base, scheduler=scheduler, pools=pools, long_prompt_tokens=threshold)


def row(label: str, summary: dict) -> str:
    short, long = summary["short"], summary["long"]
    moves = len(summary.get("pools", {}).get("moves", []))
    final = summary.get("pools", {}).get("final")
    split = "-" if final is None else f"{final.count('short')}/{final.count('long')}"
    return (f"| {label} | {summary['goodput_rps']:.3f} | {summary['overall']['slo_attainment']:.3f}"
            f" | {short['ttft_s'].get('p50', float('nan')):.3f} | "
            f"{short['ttft_s'].get('p99', float('nan')):.2f} | "
            f"{long['ttft_s'].get('p99', float('nan')):.1f} | "
            f"{long['completed']}/{long['requests']} | {summary['unfinished']} | {moves} | "
            f"{split} |")


HEADER = ("| configuration | goodput (req/s) | SLO attainment | short TTFT p50 (s) | "
          "short TTFT p99 (s) | long TTFT p99 (s) | long done | unfinished | moves | "
          "final short/long |\n|---|---|---|---|---|---|---|---|---|---|")


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("goodput (req/s)", lambda s: s["goodput_rps"], False),
               ("short TTFT p99 (s)", lambda s: s["short"]["ttft_s"].get("p99", 0.0), True),
               ("long TTFT p99 (s)", lambda s: s["long"]["ttft_s"].get("p99", 0.0), True)]
    figure, axes = plt.subplots(len(results), len(metrics), figsize=(13, 3.6 * len(results)),
                                squeeze=False)
    for row_axes, (workload, summaries) in zip(axes, results.items()):
        labels = list(summaries)
        for axis, (title, value, log) in zip(row_axes, metrics):
            axis.bar(range(len(labels)), [value(summaries[label]) for label in labels],
                     color=["#888" if "unified" in label else "#37a" if "static" in label
                            else "#d72" for label in labels])
            axis.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
            axis.set_title(f"{workload}: {title}", fontsize=10)
            if log:
                axis.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-instances", type=int, default=4)
    parser.add_argument("--spp", type=int, default=2)
    parser.add_argument("--mooncake-qps", type=float, default=12.0)
    parser.add_argument("--medha-qps", type=float, default=2.4)
    parser.add_argument("--duration-s", type=float, default=900.0, help="arrivals in [0, this)")
    parser.add_argument("--horizon-s", type=float, default=1200.0)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--only", default=None, help="run one workload (mooncake, medha-mixed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, meta = load_model("h100-llama3-8b-tp8")
    instance = InstanceConfig(tp=meta.tp, spp=args.spp,
                              num_kv_blocks=estimate_kv_blocks(meta, meta.tp, args.spp, 1))
    base = SimConfig(scheduler=SchedulerConfig(), instance=instance,
                     num_instances=args.num_instances, num_layers=meta.num_layers,
                     horizon_s=args.horizon_s)
    rebalance = Rebalance()  # the CRD defaults: period 30 s, cooldown 120 s, tau 0.2
    results: dict[str, dict[str, dict]] = {}
    tables = [f"Pools study: {args.num_instances} instances of H100 Llama-3-8B TP8 SPP "
              f"{args.spp}, arrivals for {args.duration_s:.0f} s, horizon {args.horizon_s:.0f} s, "
              f"rebalancer period {rebalance.period_seconds} s, cooldown "
              f"{rebalance.cooldown_seconds} s, hysteresis {rebalance.hysteresis}.\n"]
    for workload in workloads(args):
        if args.only and workload.name != args.only:
            continue
        requests = build_workload(workload.spec)
        short = short_split(requests, workload.long_threshold_tokens, args.num_instances)
        long_count = sum(r.prompt_tokens >= workload.long_threshold_tokens for r in requests)
        tables.append(f"\n### {workload.name} ({workload.spec.qps} QPS, {len(requests)} requests, "
                      f"{long_count} long at >= {workload.long_threshold_tokens} tokens; "
                      f"static split {short} short / {args.num_instances - short} long)\n\n"
                      f"{HEADER}")
        summaries = {}
        for label in args.configs:
            config = sim_config(label, base, short, workload.long_threshold_tokens, rebalance)
            started = time.perf_counter()
            result = simulate(requests, config, model)
            summary = {"label": label, **summarize(result, workload.long_threshold_tokens, None)}
            if config.pools is not None:
                summary["pools"] = {"mode": config.pools.mode, "short_instances": short,
                                    "final": result.final_pools, "moves": result.pool_moves}
            summaries[label] = summary
            tables.append(row(label, summary))
            print(f"{workload.name} {label}: goodput {summary['goodput_rps']:.3f}, short p99 "
                  f"{summary['short']['ttft_s'].get('p99', float('nan')):.2f} s, long p99 "
                  f"{summary['long']['ttft_s'].get('p99', float('nan')):.1f} s, "
                  f"{time.perf_counter() - started:.0f} s wall", flush=True)
        results[workload.name] = summaries
    stem = "pools_study" if args.only is None else f"pools_study_{args.only}"
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
        indent=2) + "\n")
    (args.out / f"{stem}_tables.md").write_text("\n".join(tables) + "\n")
    plot(results, args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
