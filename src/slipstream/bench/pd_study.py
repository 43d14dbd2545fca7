"""Prefill/decode disaggregation against mixed instances, at equal GPU count, and the live
KV transfer engines: the study in docs/disaggregation.md.

Simulator (H100 Llama-3-8B TP8 tables, the real scheduler on both sides):

- ``mixed``: ``--num-instances`` mixed instances with LARS, least-backlog routing;
- ``pd-1:1``, ``pd-1:3``: the same GPUs split into prefill and decode instances;
- ``pd-pools``: as ``pd-1:1``, with the prefill instances in PLA-Serve short/long pools;

for Medha's mixed workload and the Mooncake trace, over ``--loads`` (QPS), with the KV
moved over ``--link-gbit`` per GPU. A second sweep varies the link (25, 100, 400 Gb/s) for
``pd-1:1`` at the middle load. Reported: TTFT and TPOT p50/p99, throughput, and SLO goodput
at two TPOT objectives (``--tpot-slo-ms``), so the crossover shows as load and SLO vary.

Live (``--live``, this machine's CPU): the Mooncake Transfer Engine (TCP) and the ZeroMQ
transport move KV blocks between two registered caches; per-read latency for 1, 8 and 32
blocks and throughput in MB/s.

    python -m slipstream.bench.pd_study --out results/pd
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.sim.cli import load_model
from slipstream.sim.disagg import DisaggConfig, equal_gpu_split, simulate_disagg
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.kv_capacity import estimate_kv_blocks
from slipstream.sim.pools import PoolsConfig
from slipstream.sim.report import summarize
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.workloads import WorkloadSpec, build_workload

CONFIGS = ("mixed", "pd-1:1", "pd-1:3", "pd-pools")
WORKLOADS = {  # name: (spec builder, long threshold in tokens)
    "medha-mixed": (lambda qps, args: WorkloadSpec(recipe="medha-mixed", qps=qps,
                                                   duration_s=args.duration_s, seed=args.seed),
                    8192),
    "mooncake": (lambda qps, args: WorkloadSpec(trace="mooncake", qps=qps,
                                                duration_s=args.duration_s, seed=args.seed),
                 32_768),
}


def _metrics(summary: dict, strict: dict) -> dict:
    overall = summary["overall"]
    return {
        "ttft_p50_s": overall["ttft_s"].get("p50"), "ttft_p99_s": overall["ttft_s"].get("p99"),
        "tpot_p50_ms": overall["tpot_ms"].get("p50"), "tpot_p99_ms": overall["tpot_ms"].get("p99"),
        "throughput_rps": summary["throughput_rps"],
        "output_tokens_per_s": summary["output_throughput_tps"],
        "goodput_rps": summary["goodput_rps"], "goodput_strict_rps": strict["goodput_rps"],
        "completed": summary["completed"], "unfinished": summary["unfinished"],
        "sim_wall_s": summary["sim"]["wall_s"],
    }


def run_config(label: str, requests, base: SimConfig, model, num_instances: int,
               threshold: int, link_gbit: float, args: argparse.Namespace) -> dict:
    config = replace(base, long_prompt_tokens=threshold)
    if label == "mixed":
        result = simulate(requests, replace(config, num_instances=num_instances), model)
    else:
        ratio = (1, 3) if label == "pd-1:3" else (1, 1)
        prefill, decode = equal_gpu_split(num_instances, ratio)
        if label == "pd-pools":
            config = replace(config, pools=PoolsConfig(
                mode="static", short_instances=max(1, prefill // 2),
                long_threshold_tokens=threshold))
        result = simulate_disagg(requests, config, DisaggConfig(
            prefill, decode, link_gbit_per_s=link_gbit), model)
    summary = summarize(result, threshold, args.tpot_slo_ms[0])
    strict = summarize(result, threshold, args.tpot_slo_ms[1])
    return _metrics(summary, strict)


def simulate_study(args: argparse.Namespace) -> dict:
    model, meta = load_model("h100-llama3-8b-tp8")
    instance = InstanceConfig(tp=meta.tp, spp=1,
                              num_kv_blocks=estimate_kv_blocks(meta, meta.tp, 1, 1))
    base = SimConfig(scheduler=SchedulerConfig(policy="lars"), instance=instance,
                     num_layers=meta.num_layers, horizon_s=args.horizon_s)
    results: dict = {}
    for workload, (spec_for, threshold) in WORKLOADS.items():
        if args.only and workload != args.only:
            continue
        loads = args.mooncake_loads if workload == "mooncake" else args.medha_loads
        by_load: dict = {}
        for qps in loads:
            requests = build_workload(spec_for(qps, args))
            by_load[str(qps)] = {}
            for label in args.configs:
                metrics = run_config(label, requests, base, model, args.num_instances,
                                     threshold, args.link_gbit, args)
                by_load[str(qps)][label] = metrics
                print(f"{workload} {qps} QPS {label}: goodput {metrics['goodput_rps']:.2f} "
                      f"(strict {metrics['goodput_strict_rps']:.2f}), TTFT p99 "
                      f"{metrics['ttft_p99_s'] or float('nan'):.2f} s, TPOT p99 "
                      f"{metrics['tpot_p99_ms'] or float('nan'):.1f} ms, "
                      f"{metrics['sim_wall_s']:.0f} s wall", flush=True)
        middle = loads[len(loads) // 2]
        requests = build_workload(spec_for(middle, args))
        links = {str(gbit): run_config("pd-1:1", requests, base, model, args.num_instances,
                                       threshold, gbit, args) for gbit in args.link_sweep}
        results[workload] = {"loads": by_load, "link_sweep": {"qps": middle, "pd-1:1": links}}
    return results


def live_transfer(args: argparse.Namespace) -> dict:
    """Per-read latency and throughput of the transports on this machine."""
    import torch

    from slipstream.agent.engine.kv.transfer.layout import KVLayout, regions_of
    from slipstream.agent.engine.kv.transfer.side_channel import (
        SideChannelClient, SideChannelServer)
    from slipstream.agent.engine.kv.transfer.transport import KVHandle, make_transport

    # 8 layers x 8 KV heads x 64 dims x 16 tokens, fp32: 32 KiB per region, 512 KiB a block.
    shape = (256, 16, 8, 64)
    source = [(torch.randn(shape), torch.randn(shape)) for _ in range(8)]
    target = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(8)]
    layout = KVLayout.of(source)
    results: dict = {"block_bytes": layout.bytes_per_block, "layout": layout.to_dict()}
    for name in ("mooncake", "zmq"):
        held = {"t": tuple(range(256))}
        holder = make_transport(name, layout, regions_of(source), "127.0.0.1")
        server = SideChannelServer("127.0.0.1", 0, held.get, lambda _tid: True,
                                   regions_of(source) if name == "zmq" else None)
        reader = make_transport(name, layout, regions_of(target), "127.0.0.1",
                                side_channel=SideChannelClient(timeout_s=30))
        handle = KVHandle("t", name, server.address, holder.endpoint, holder.region_addrs(),
                          layout, tuple(range(256)), 256 * 16, "", 0)
        per_size: dict = {}
        for blocks in (1, 8, 32):
            latencies = []
            for repeat in range(args.live_repeats):
                start = (repeat * blocks) % (256 - blocks)
                ids = list(range(start, start + blocks))
                began = time.perf_counter()
                reader.read_blocks(handle, ids, ids[::-1])  # scattered on the reader's side
                latencies.append(time.perf_counter() - began)
            latencies.sort()
            mean_s = statistics.fmean(latencies)
            per_size[str(blocks)] = {
                "p50_ms": latencies[len(latencies) // 2] * 1000,
                "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
                "per_block_ms": mean_s * 1000 / blocks,
                "mb_per_s": blocks * layout.bytes_per_block / mean_s / 1e6}
            print(f"live {name}: {blocks} blocks per read: p50 "
                  f"{per_size[str(blocks)]['p50_ms']:.2f} ms, "
                  f"{per_size[str(blocks)]['mb_per_s']:.0f} MB/s", flush=True)
        # One read checked byte for byte: remote blocks 10..41 into local 41..10 (scattered),
        # every region (layer, K and V).
        for layer in target:
            for tensor in layer:
                tensor.zero_()
        remote_ids = list(range(10, 42))
        local_ids = remote_ids[::-1]
        reader.read_blocks(handle, remote_ids, local_ids)
        ok = all(torch.equal(src[kv][remote], dst[kv][local])
                 for src, dst in zip(source, target) for kv in (0, 1)
                 for remote, local in zip(remote_ids, local_ids))
        results[name] = {"reads": per_size, "bytes_checked_equal": ok}
        reader.close()
        server.close()
        holder.close()
    return results


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(results: dict, live: dict | None, args: argparse.Namespace) -> str:
    """The study as markdown tables (what docs/disaggregation.md quotes)."""
    lines = [f"{args.num_instances} H100 Llama-3-8B TP8 instances in every configuration; "
             f"arrivals for {args.duration_s:g} s, horizon {args.horizon_s:g} s; KV link "
             f"{args.link_gbit:g} Gb/s per GPU; goodput at TPOT <= {args.tpot_slo_ms[0]:g} ms "
             f"and (strict) <= {args.tpot_slo_ms[1]:g} ms, TTFT within the scheduler's "
             "deadline.\n"]
    header = ("| QPS | configuration | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | "
              "TPOT p99 (ms) | throughput (req/s) | goodput (req/s) | goodput strict | "
              "unfinished |\n|---|---|---|---|---|---|---|---|---|---|")
    for workload, result in results.items():
        lines += [f"\n### {workload}\n", header]
        for qps, by_config in result["loads"].items():
            for label, m in by_config.items():
                lines.append(
                    f"| {qps} | {label} | {_fmt(m['ttft_p50_s'], 2)} | {_fmt(m['ttft_p99_s'], 2)}"
                    f" | {_fmt(m['tpot_p50_ms'], 1)} | {_fmt(m['tpot_p99_ms'], 1)} | "
                    f"{m['throughput_rps']:.2f} | {m['goodput_rps']:.2f} | "
                    f"{m['goodput_strict_rps']:.2f} | {m['unfinished']} |")
        sweep = result["link_sweep"]
        lines += [f"\nLink sweep, pd-1:1 at {sweep['qps']} QPS:\n",
                  "| link (Gb/s per GPU) | TTFT p50 (s) | TTFT p99 (s) | goodput (req/s) |",
                  "|---|---|---|---|"]
        for gbit, m in sweep["pd-1:1"].items():
            lines.append(f"| {gbit} | {_fmt(m['ttft_p50_s'], 3)} | {_fmt(m['ttft_p99_s'], 2)} | "
                         f"{m['goodput_rps']:.2f} |")
    if live:
        lines += [f"\n### Live KV transfer on this machine's CPU ({live['block_bytes']} bytes "
                  "per block)\n", "| transport | blocks per read | p50 (ms) | p99 (ms) | "
                  "ms per block | MB/s |", "|---|---|---|---|---|---|"]
        for name in ("mooncake", "zmq"):
            for blocks, m in live[name]["reads"].items():
                lines.append(f"| {name} | {blocks} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                             f"{m['per_block_ms']:.3f} | {m['mb_per_s']:.0f} |")
        checked = ", ".join(f"{name} {'equal' if live[name]['bytes_checked_equal'] else 'DIFFER'}"
                            for name in ("mooncake", "zmq"))
        lines.append(f"\nA scattered 32-block read checked byte for byte: {checked}.")
    return "\n".join(lines) + "\n"


def plot(results: dict, live: dict | None, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("goodput (req/s)", "goodput_rps", False),
               (f"goodput, TPOT <= {args.tpot_slo_ms[1]:g} ms", "goodput_strict_rps", False),
               ("TTFT p99 (s)", "ttft_p99_s", True), ("TPOT p99 (ms)", "tpot_p99_ms", True)]
    rows = list(results)
    if not rows and not live:
        return
    figure, axes = plt.subplots(len(rows) + (1 if live else 0), len(metrics),
                                figsize=(16, 3.6 * (len(rows) + (1 if live else 0))),
                                squeeze=False)
    colors = {"mixed": "#555", "pd-1:1": "#37a", "pd-1:3": "#d72", "pd-pools": "#3a5"}
    for row_axes, workload in zip(axes, rows):
        by_load = results[workload]["loads"]
        loads = [float(q) for q in by_load]
        for axis, (title, key, log) in zip(row_axes, metrics):
            for label in args.configs:
                values = [by_load[q][label][key] or float("nan") for q in by_load]
                axis.plot(loads, values, marker="o", label=label, color=colors.get(label))
            axis.set_title(f"{workload}: {title}", fontsize=10)
            axis.set_xlabel("load (QPS)")
            if log:
                axis.set_yscale("log")
        row_axes[0].legend(fontsize=8)
    if live:
        live_axes = axes[-1]
        for name, color in (("mooncake", "#37a"), ("zmq", "#d72")):
            reads = live[name]["reads"]
            sizes = [int(b) for b in reads]
            live_axes[0].plot(sizes, [reads[str(b)]["per_block_ms"] for b in sizes], marker="o",
                              label=name, color=color)
            live_axes[1].plot(sizes, [reads[str(b)]["mb_per_s"] for b in sizes], marker="o",
                              label=name, color=color)
        live_axes[0].set_title("live CPU: ms per block (mean)", fontsize=10)
        live_axes[1].set_title("live CPU: MB/s", fontsize=10)
        for axis in live_axes[:2]:
            axis.set_xlabel("blocks per read")
            axis.set_xscale("log", base=2)
            axis.legend(fontsize=8)
        for axis in live_axes[2:]:
            axis.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-instances", type=int, default=4,
                        help="TP8 instances in every configuration (equal GPU count)")
    parser.add_argument("--medha-loads", type=float, nargs="+", default=[1.0, 2.0, 4.0, 6.0])
    parser.add_argument("--mooncake-loads", type=float, nargs="+", default=[4.0, 8.0, 12.0, 16.0])
    parser.add_argument("--duration-s", type=float, default=150.0, help="arrivals in [0, this)")
    parser.add_argument("--horizon-s", type=float, default=300.0)
    parser.add_argument("--link-gbit", type=float, default=100.0,
                        help="KV link per GPU, Gb/s, for the load sweep")
    parser.add_argument("--link-sweep", type=float, nargs="+", default=[25.0, 100.0, 400.0])
    parser.add_argument("--tpot-slo-ms", type=float, nargs=2, default=[50.0, 20.0],
                        metavar=("MS", "STRICT_MS"),
                        help="TPOT objectives for goodput (with the scheduler's TTFT deadlines)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--only", default=None, choices=sorted(WORKLOADS))
    parser.add_argument("--live", action="store_true", help="also measure the live transports")
    parser.add_argument("--live-repeats", type=int, default=50)
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator study")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    live = live_transfer(args) if args.live else None
    results = {} if args.no_sim else simulate_study(args)
    (args.out / "pd_study.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "simulated": results,
         "live_transfer": live, "wall_s": time.perf_counter() - started}, indent=2) + "\n")
    (args.out / "pd_study_tables.md").write_text(tables(results, live, args))
    plot(results, live, args.out / "pd_study.png", args)
    print(f"wrote {args.out / 'pd_study.json'} and {args.out / 'pd_study.png'}")


if __name__ == "__main__":
    main()
