"""Prefix caching, measured: the simulator on Mooncake's conversation trace, and the live CPU
engine on a multi-turn workload over long shared documents (docs/prefix-caching.md).

    simulator: H100 Llama-3-8B tables, Mooncake (hash_ids, 512 tokens each), N instances
        (a) FCFS, no cache, least-load routing
        (b) FCFS, cache, least-load routing          (vLLM's prefix caching behind a plain LB)
        (c) FCFS, cache, prefix-aware routing        (llm-d: backlog counted in full)
        (d) LARS, cache, prefix-aware routing        (Slipstream: the router counts only the
                                                      backlog a shorter-first instance puts
                                                      ahead of the request)
        (x), (y): each of (d)'s two changes alone (LARS behind (c)'s router; (d)'s router in
                  front of FCFS instances)
        --> hit rate against the unbounded-cache bound, short/long TTFT p50/p99, throughput
    live: the tiny CPU model, in-process engine on the real clock; documents x questions
        arriving open-loop, once with the cache and once without; then one follow-up question
        on a cached 8K-token document against the same question cold
        --> TTFT p50/p99, throughput, hit rate; follow-up TTFT / cold TTFT

Writes OUT/sim_results.json, OUT/sim_tables.md, OUT/sim_ttft_cdf.png, OUT/sim_hit_rate.png,
OUT/live_results.json and OUT/live_ttft.png::

    python -m slipstream.bench.prefix_bench --out results/prefix
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

SYSTEMS = {  # label: (policy, prefix caching, routing, the router's instance queue order)
    "a_fcfs_nocache_leastload": ("fcfs", False, "least-load", "fifo"),
    "b_fcfs_cache_leastload": ("fcfs", True, "least-load", "fifo"),
    "c_fcfs_cache_prefix": ("fcfs", True, "prefix", "fifo"),
    "d_lars_cache_prefix": ("lars", True, "prefix", "shorter-first"),
}
# Each of (d)'s two changes alone, to show what each contributes (not part of the goals):
# LARS behind (c)'s router, and (d)'s router in front of FCFS instances.
ABLATIONS = {
    "x_lars_cache_prefix_fifo_router": ("lars", True, "prefix", "fifo"),
    "y_fcfs_cache_prefix_shorter_first_router": ("fcfs", True, "prefix", "shorter-first"),
}


# -- simulator ------------------------------------------------------------------------------

def run_sim(args: argparse.Namespace) -> dict:
    from slipstream.agent.scheduler.config import SchedulerConfig
    from slipstream.sim.cli import load_model
    from slipstream.sim.instance import InstanceConfig
    from slipstream.sim.kv_capacity import estimate_kv_blocks
    from slipstream.sim.plots import ttft_cdf
    from slipstream.sim.report import summarize
    from slipstream.sim.simulator import SimConfig, simulate
    from slipstream.sim.workloads import WorkloadSpec, build_workload

    model, meta = load_model("h100-llama3-8b-tp8")
    instance = InstanceConfig(tp=meta.tp, spp=args.spp,
                              num_kv_blocks=estimate_kv_blocks(meta, meta.tp, args.spp, 1))
    requests = build_workload(WorkloadSpec(trace="mooncake", qps=args.qps,
                                           duration_s=args.duration_s, seed=0))
    results: dict = {"config": {"instances": args.instances, "qps": args.qps,
                                "duration_s": args.duration_s, "spp": args.spp,
                                "tp": meta.tp, "kv_blocks_per_instance": instance.num_kv_blocks,
                                "requests": len(requests),
                                "long_prompt_tokens": args.long_prompt_tokens},
                     "systems": {}}
    sims = {}
    systems = dict(SYSTEMS, **(ABLATIONS if args.ablations else {}))
    results["config"]["systems"] = {
        label: {"policy": policy, "prefix_caching": caching, "routing": routing,
                "router_instance_queue_order": order}
        for label, (policy, caching, routing, order) in systems.items()}
    for label, (policy, caching, routing, queue_order) in systems.items():
        scheduler = SchedulerConfig(policy=policy, prefix_caching=caching)
        if policy == "fcfs":  # plain chunked prefill, as bench-sim's fcfs@0
            scheduler = replace(scheduler, max_space_share_fraction=0.0)
        config = SimConfig(scheduler=scheduler, instance=instance, num_instances=args.instances,
                           num_layers=meta.num_layers, horizon_s=args.horizon_s,
                           long_prompt_tokens=args.long_prompt_tokens, routing=routing,
                           router_queue_order=queue_order)
        started = time.perf_counter()
        sims[label] = simulate(requests, config, model)
        summary = summarize(sims[label], args.long_prompt_tokens, None)
        results["systems"][label] = summary
        cache = summary["prefix_cache"]
        print(f"{label}: {time.perf_counter() - started:.0f}s wall, hit rate "
              f"{cache['hit_rate']:.3f} (bound {cache['bound_hit_rate']:.3f}), short p99 TTFT "
              f"{summary['short']['ttft_s'].get('p99', float('nan')):.3f}s", flush=True)
    d, c = results["systems"]["d_lars_cache_prefix"], results["systems"]["c_fcfs_cache_prefix"]
    results["goals"] = {
        "d_fraction_of_bound": d["prefix_cache"]["fraction_of_bound"],
        "c_over_d_short_ttft_p99": c["short"]["ttft_s"]["p99"] / d["short"]["ttft_s"]["p99"],
    }
    out = args.out
    (out / "sim_results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "sim_tables.md").write_text(sim_table(results) + "\n")
    ttft_cdf(sims, out / "sim_ttft_cdf.png", args.long_prompt_tokens,
             f"Mooncake, {args.instances} instances, {args.qps:g} QPS: TTFT CDF")
    hit_rate_plot(results, out / "sim_hit_rate.png")
    print(sim_table(results))
    return results


def sim_table(results: dict) -> str:
    rows = ["| system | hit rate | of bound | short TTFT p50 (s) | short TTFT p99 (s) | "
            "long TTFT p50 (s) | long TTFT p99 (s) | throughput (req/s) | completed |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, s in results["systems"].items():
        cache, short, long = s["prefix_cache"], s["short"]["ttft_s"], s["long"]["ttft_s"]
        rows.append(f"| {label} | {cache['hit_rate']:.3f} | {cache['fraction_of_bound']:.2f} | "
                    f"{short.get('p50', float('nan')):.3f} | {short.get('p99', float('nan')):.3f} | "
                    f"{long.get('p50', float('nan')):.2f} | {long.get('p99', float('nan')):.2f} | "
                    f"{s['throughput_rps']:.3f} | {s['completed']}/{s['requests']} |")
    bound = next(iter(results["systems"].values()))["prefix_cache"]["bound_hit_rate"]
    goals = results["goals"]
    rows.append(f"\nUnbounded-cache bound: {bound:.3f} of prompt tokens. (d) reaches "
                f"{goals['d_fraction_of_bound']:.2f} of it; (c)'s short p99 TTFT is "
                f"{goals['c_over_d_short_ttft_p99']:.2f}x (d)'s.")
    return "\n".join(rows)


def hit_rate_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results["systems"])
    rates = [results["systems"][k]["prefix_cache"]["hit_rate"] for k in labels]
    bound = results["systems"][labels[0]]["prefix_cache"]["bound_hit_rate"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(labels)), rates, color="tab:blue")
    ax.axhline(bound, color="tab:red", linestyle="--", label="unbounded-cache bound")
    ax.set_xticks(range(len(labels)), [label.split("_", 1)[1] for label in labels], fontsize=8)
    ax.set_ylabel("prompt tokens found cached")
    ax.legend()
    ax.set_title("Prefix-cache hit rate, Mooncake conversation trace")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- live CPU engine ------------------------------------------------------------------------

def run_live(args: argparse.Namespace) -> dict:
    from slipstream.agent.engine.config import EngineConfig
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.contracts.sampling import SamplingParams
    from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir, write_tiny_model
    from slipstream.agent.scheduler.config import SchedulerConfig

    model_dir = slipstream_cache_dir() / "models" / f"tiny-{args.model_preset}"
    if not (model_dir / "config.json").is_file():
        write_tiny_model(model_dir, args.model_preset, seed=0)
    rng = random.Random(0)
    documents = [[rng.randrange(10, 4000) for _ in range(args.document_tokens)]
                 for _ in range(args.documents)]
    workload = []  # (arrival_s, prompt): every document's questions, interleaved, open loop
    clock = 0.0
    for turn in range(args.questions):
        for document in documents:
            question = [rng.randrange(10, 4000) for _ in range(args.question_tokens)]
            workload.append((clock, document + question))
            clock += rng.expovariate(args.live_qps)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)

    def engine(caching: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu",
                                      num_kv_blocks=args.live_kv_blocks),
                         SchedulerConfig(max_batched_tokens=args.max_batched_tokens,
                                         prefix_caching=caching))

    results: dict = {"config": {key: getattr(args, key) for key in (
        "model_preset", "documents", "document_tokens", "questions", "question_tokens",
        "output_tokens", "live_qps", "live_kv_blocks", "max_batched_tokens")}, "runs": {}}
    for caching in (False, True):
        results["runs"]["cache" if caching else "no_cache"] = replay(engine(caching), workload,
                                                                     params)
        print(f"live cache={caching}: {results['runs']['cache' if caching else 'no_cache']}",
              flush=True)
    # One follow-up question on a cached 8K-token document against the same question cold.
    long_doc = [rng.randrange(10, 4000) for _ in range(args.follow_up_document_tokens)]
    follow_up = long_doc + [rng.randrange(10, 4000) for _ in range(args.question_tokens)]
    warm_engine = engine(True)
    replay(warm_engine, [(0.0, long_doc + [7] * args.question_tokens)], params)
    warm = [replay(warm_engine, [(0.0, follow_up[:-1] + [11 + i])], params)["ttft_s"]["p50"]
            for i in range(args.repeats)]
    cold = [replay(engine(False), [(0.0, follow_up[:-1] + [11 + i])], params)["ttft_s"]["p50"]
            for i in range(args.repeats)]
    results["follow_up"] = {"document_tokens": args.follow_up_document_tokens,
                            "cold_ttft_s": float(np.median(cold)),
                            "warm_ttft_s": float(np.median(warm)),
                            "ratio": float(np.median(warm) / np.median(cold)),
                            "repeats": args.repeats}
    print(f"follow-up on a cached {args.follow_up_document_tokens}-token document: "
          f"{results['follow_up']}", flush=True)
    (args.out / "live_results.json").write_text(json.dumps(results, indent=2) + "\n")
    live_plot(results, args.out / "live_ttft.png")
    return results


def replay(engine, workload: list[tuple[float, list[int]]], params) -> dict:
    """Add each prompt when its arrival time has passed on the real clock; step in between."""
    start = time.monotonic()
    pending = list(workload)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    output_tokens = 0
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            at, prompt = pending.pop(0)
            arrival[engine.add_request(prompt, params)] = start + at
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.01, pending[0][0] - now)))
            continue
        for output in engine.step():
            output_tokens += len(output.new_token_ids)
            if output.request_id not in first and output.new_token_ids:
                first[output.request_id] = time.monotonic()
    elapsed = time.monotonic() - start
    ttfts = [first[rid] - arrival[rid] for rid in arrival]
    stats = engine.stats()
    lookups = stats.prefix_cache_lookup_tokens
    engine.close()
    return {"requests": len(arrival), "elapsed_s": elapsed,
            "ttft_s": {"p50": float(np.percentile(ttfts, 50)),
                       "p99": float(np.percentile(ttfts, 99)),
                       "mean": float(np.mean(ttfts))},
            "throughput_rps": len(arrival) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "hit_rate": stats.prefix_cache_hit_tokens / lookups if lookups else 0.0}


def live_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(runs)
    for offset, key in enumerate(("p50", "p99")):
        axes[0].bar([i + 0.4 * offset for i in range(len(names))],
                    [runs[n]["ttft_s"][key] for n in names], width=0.4, label=f"TTFT {key}")
    axes[0].set_xticks([i + 0.2 for i in range(len(names))], names)
    axes[0].set_ylabel("seconds")
    axes[0].legend()
    axes[0].set_title("Multi-turn over shared documents")
    follow = results["follow_up"]
    axes[1].bar([0, 1], [follow["cold_ttft_s"], follow["warm_ttft_s"]],
                color=["tab:gray", "tab:green"])
    axes[1].set_xticks([0, 1], ["cold", "cached document"])
    axes[1].set_ylabel("TTFT (s)")
    axes[1].set_title(f"Follow-up on a {follow['document_tokens']}-token document")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", choices=("sim", "live"), default=None)
    sim = parser.add_argument_group("simulator")
    sim.add_argument("--instances", type=int, default=4)
    sim.add_argument("--qps", type=float, default=12.0, help="Mooncake replayed at this rate")
    sim.add_argument("--duration-s", type=float, default=300.0)
    sim.add_argument("--horizon-s", type=float, default=450.0)
    sim.add_argument("--spp", type=int, default=1)
    sim.add_argument("--long-prompt-tokens", type=int, default=16384)
    sim.add_argument("--no-ablations", dest="ablations", action="store_false",
                     help="run only systems (a)-(d), not the two that each take one of (d)'s "
                          "changes alone")
    live = parser.add_argument_group("live CPU engine")
    live.add_argument("--model-preset", default="tiny")
    live.add_argument("--documents", type=int, default=3)
    live.add_argument("--document-tokens", type=int, default=4096)
    live.add_argument("--questions", type=int, default=4)
    live.add_argument("--question-tokens", type=int, default=32)
    live.add_argument("--output-tokens", type=int, default=16)
    live.add_argument("--live-qps", type=float, default=2.0)
    live.add_argument("--live-kv-blocks", type=int, default=4096)
    live.add_argument("--max-batched-tokens", type=int, default=2048)
    live.add_argument("--follow-up-document-tokens", type=int, default=8192)
    live.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "sim"):
        run_sim(args)
    if args.only in (None, "live"):
        run_live(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
