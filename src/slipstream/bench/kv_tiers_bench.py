"""KV tiers: hit rate and short-request tail in the simulator, and a follow-up's first token on
the live CPU engine, with the host (and disk) tier on and off.

    python -m slipstream.bench.kv_tiers_bench --out results/kv-tiers [--only sim|live]
        [--trace mooncake|PATH]

Simulator (``sim_results.json``, ``sim_tables.md``, ``sim_hit_rate.png``): one instance of
the H100 Llama-3-8B TP8 tables under LARS, the trace at its own arrival times, the KV pool
sized from GPU memory; systems: no tier, a host tier sized like a real node (1 TiB per 8-GPU
instance) and one twice that, the first plus a disk tier, and an unlimited device pool (the
bound). All in one
command, so every system gets the same requests.

Live (``live_results.json``, ``live_ttft.png``): the in-process engine on the tiny model with
a device pool too small for two 16K-token documents. A question over document A (cold), then
questions over documents that evict A, then a follow-up over A: its time to first token with
no tier (A recomputed), from the host tier, and from the disk tier (a host tier of one
document, so A is pushed on to disk). Greedy outputs of every run are compared.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.sim.cli import load_model
from slipstream.sim.datasets import H100_PROFILE
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.kv_capacity import (
    NVME_GB_PER_S, PCIE_GB_PER_S, estimate_kv_blocks, kv_bytes_per_block)
from slipstream.sim.report import summarize
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.workloads import WorkloadSpec, build_workload

GIB = 2**30
DOC_TOKENS = 16_384


# -- simulator ----------------------------------------------------------------------------------

def sim_systems(host_gib: list[float], disk_gib: float
                ) -> list[tuple[str, float, float, bool, float | None]]:
    """(label, host GiB, disk GiB, unlimited device pool, host protected fraction): no
    tier, each host size, the first host size as a plain LRU (the policy before the
    segmented one, tier_index.py), the first host size with the disk under it, and an
    unlimited device pool (the bound)."""
    return [("no tier", 0.0, 0.0, False, None),
            *((f"host {size:g} GiB", size, 0.0, False, None) for size in host_gib),
            (f"host {host_gib[0]:g} GiB, plain LRU", host_gib[0], 0.0, False, 0.0),
            (f"host {host_gib[0]:g} GiB + disk {disk_gib:g} GiB", host_gib[0], disk_gib, False,
             None),
            ("unlimited device pool", 0.0, 0.0, True, None)]


def run_sim(args: argparse.Namespace) -> dict:
    model, meta = load_model(H100_PROFILE)
    spec = WorkloadSpec(trace=args.trace, qps=args.qps, duration_s=args.duration_s,
                        seed=args.seed)
    requests = build_workload(spec)
    blocks = estimate_kv_blocks(meta, meta.tp, 1, 1)
    block_bytes = kv_bytes_per_block(meta)
    scheduler = SchedulerConfig(policy="lars")
    rows = []
    for label, host_gib, disk_gib, unlimited, protected in sim_systems(args.host_gib,
                                                                       args.disk_gib):
        instance = InstanceConfig(
            tp=meta.tp, num_kv_blocks=blocks * 1000 if unlimited else blocks,
            hidden_size=meta.model.get("hidden_size", 4096),
            kv_host_blocks=int(host_gib * GIB) // block_bytes,
            kv_disk_blocks=int(disk_gib * GIB) // block_bytes,
            kv_bytes_per_block=block_bytes if host_gib else 0,
            host_load_gb_per_s=PCIE_GB_PER_S * meta.tp, disk_read_gb_per_s=NVME_GB_PER_S,
            kv_host_protected_fraction=protected)
        config = SimConfig(scheduler=scheduler, instance=instance, num_layers=meta.num_layers,
                           horizon_s=args.horizon_s, long_prompt_tokens=args.long_prompt_tokens)
        result = simulate(requests, config, model)
        summary = summarize(result, args.long_prompt_tokens, None)
        cache = summary["prefix_cache"]
        rows.append({"system": label, "host_gib": host_gib, "disk_gib": disk_gib,
                     "device_blocks": instance.num_kv_blocks,
                     "host_blocks": instance.kv_host_blocks,
                     "disk_blocks": instance.kv_disk_blocks,
                     "host_protected_fraction": (tiers.host_protected_fraction
                                                 if (tiers := instance.tier_config()) else None),
                     "hit_rate": cache["hit_rate"], "bound_hit_rate": cache["bound_hit_rate"],
                     "fraction_of_bound": cache["fraction_of_bound"],
                     "hit_tokens_by_tier": cache["hit_tokens_by_tier"],
                     "short_ttft_p50_s": summary["short"]["ttft_s"]["p50"],
                     "short_ttft_p99_s": summary["short"]["ttft_s"]["p99"],
                     "long_ttft_p99_s": summary["long"]["ttft_s"]["p99"],
                     "completed": summary["completed"], "requests": summary["requests"],
                     "sim_wall_s": result.wall_s})
        print(json.dumps(rows[-1]), flush=True)
    return {"trace": str(args.trace), "qps": args.qps, "duration_s": args.duration_s,
            "horizon_s": args.horizon_s, "policy": "lars", "profile": H100_PROFILE,
            "bytes_per_block": block_bytes, "host_load_gb_per_s": PCIE_GB_PER_S * meta.tp,
            "disk_read_gb_per_s": NVME_GB_PER_S, "long_prompt_tokens": args.long_prompt_tokens,
            "rows": rows}


def sim_table(results: dict) -> str:
    lines = ["| system | hit rate | of bound | from device / host / disk (M tokens) | "
             "short TTFT p50 (s) | short TTFT p99 (s) | long TTFT p99 (s) | completed |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        tiers = row["hit_tokens_by_tier"]
        split = " / ".join(f"{tiers.get(t, 0) / 1e6:.2f}" for t in ("device", "host", "disk"))
        lines.append(f"| {row['system']} | {row['hit_rate']:.3f} | {row['fraction_of_bound']:.2f} "
                     f"| {split} | {row['short_ttft_p50_s']:.3f} | {row['short_ttft_p99_s']:.3f} "
                     f"| {row['long_ttft_p99_s']:.2f} | {row['completed']}/{row['requests']} |")
    return "\n".join(lines) + "\n"


# -- live ---------------------------------------------------------------------------------------

def live_prompts(seed: int, evictors: int) -> list[list[int]]:
    rng = random.Random(seed)
    doc = [rng.randrange(4000) for _ in range(DOC_TOKENS)]
    others = [[rng.randrange(4000) for _ in range(DOC_TOKENS)] + [7, 8] for _ in range(evictors)]
    return [doc + [11, 12, 13], *others, doc + [21, 22, 23, 24]]


def first_token(engine, prompt: list[int], params) -> tuple[float, list[int]]:
    """Seconds from adding ``prompt`` to its first token, and its whole greedy output."""
    started = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    ttft = None
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id:
                tokens.extend(output.new_token_ids)
                if ttft is None and output.new_token_ids:
                    ttft = time.perf_counter() - started
        if engine.has_unfinished() and (wait_s := engine.idle_wait_s()) > 0:
            time.sleep(wait_s)
    assert ttft is not None
    return ttft, tokens


def run_live(args: argparse.Namespace) -> dict:
    from slipstream.bench.sim_vs_live import model_dir_for
    from slipstream.agent.engine.config import EngineConfig, ModelConfig
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.agent.engine.kv.tier_settings import KVTierSettings
    from slipstream.contracts.sampling import SamplingParams

    model_dir = model_dir_for(args.model_preset)
    model = ModelConfig.from_dir(model_dir)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    device_blocks = DOC_TOKENS // 16 + 128  # one document and change: never two
    doc_blocks = DOC_TOKENS // 16 + 1
    block_bytes = 16 * model.kv_bytes_per_token  # float32 KV on the CPU
    disk_dir = Path(tempfile.mkdtemp(prefix="kv-tiers-bench-"))
    modes = {
        "no tier": (KVTierSettings(), 1),
        "host tier": (KVTierSettings(host_memory_bytes=4 * doc_blocks * block_bytes), 1),
        # A host tier of about one document, so two evicting documents push A on to disk.
        "disk tier": (KVTierSettings(host_memory_bytes=(doc_blocks + 64) * block_bytes,
                                     disk_path=disk_dir, disk_size_bytes=1 << 30), 2),
    }
    modes = {mode: modes[mode] for mode in args.modes}
    results: dict = {"model": args.model_preset, "doc_tokens": DOC_TOKENS,
                     "device_blocks": device_blocks, "kv_bytes_per_token":
                     model.kv_bytes_per_token, "repeats": args.repeats, "runs": {}}
    for mode, (tiers, evictors) in modes.items():
        runs = []
        for repeat in range(args.repeats):
            engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu",
                                            num_kv_blocks=device_blocks, kv_tiers=tiers),
                               SchedulerConfig(max_batched_tokens=2048))
            prompts = live_prompts(repeat, evictors)
            cold_s, cold_tokens = first_token(engine, prompts[0], params)
            for prompt in prompts[1:-1]:
                first_token(engine, prompt, params)
            follow_s, follow_tokens = first_token(engine, prompts[-1], params)
            stats = engine.stats()
            runs.append({"cold_ttft_s": cold_s, "follow_up_ttft_s": follow_s,
                         "outputs": [cold_tokens, follow_tokens],
                         "hit_tokens": stats.prefix_cache_hit_tokens,
                         "hit_tokens_host": stats.prefix_cache_hit_tokens_host,
                         "hit_tokens_disk": stats.prefix_cache_hit_tokens_disk,
                         "load_s": stats.kv_tier_load_seconds,
                         "fetch_s": stats.kv_tier_fetch_seconds})
            engine.close()
            print(mode, json.dumps({k: v for k, v in runs[-1].items() if k != "outputs"}),
                  flush=True)
        results["runs"][mode] = runs
    shutil.rmtree(disk_dir, ignore_errors=True)
    recompute = statistics.median(r["follow_up_ttft_s"] for r in results["runs"]["no tier"])
    outputs_plain = [r["outputs"] for r in results["runs"]["no tier"]]
    summary = {}
    for mode, runs in results["runs"].items():
        follow = statistics.median(r["follow_up_ttft_s"] for r in runs)
        summary[mode] = {"follow_up_ttft_s": follow, "of_recompute": follow / recompute,
                         "same_greedy_output": [r["outputs"] for r in runs] == outputs_plain}
    results["recompute_ttft_s"] = recompute
    results["summary"] = summary
    return results


def plot(sim: dict | None, live: dict | None, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if sim is not None:
        rows = sim["rows"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        labels = [r["system"] for r in rows]
        bottoms = [0.0] * len(rows)
        prompt = [r["hit_tokens_by_tier"] for r in rows]
        totals = [sum(t.values()) / max(r["hit_rate"], 1e-9) if r["hit_rate"] else 1.0
                  for r, t in zip(rows, prompt)]
        for tier, color in (("device", "tab:blue"), ("host", "tab:orange"), ("disk", "tab:green")):
            values = [t.get(tier, 0) / total for t, total in zip(prompt, totals)]
            left.bar(labels, values, bottom=bottoms, color=color, label=tier)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        left.axhline(rows[0]["bound_hit_rate"], color="k", linestyle="--", label="unbounded bound")
        left.set_ylabel("prompt tokens found cached")
        left.legend()
        left.tick_params(axis="x", labelrotation=20, labelsize=7)
        right.bar(labels, [r["short_ttft_p99_s"] for r in rows], color="tab:purple")
        right.set_ylabel("short TTFT p99 (s)")
        right.tick_params(axis="x", labelrotation=20, labelsize=7)
        fig.suptitle(f"KV tiers in the simulator: {Path(sim['trace']).name}, LARS, H100 TP8")
        fig.tight_layout()
        fig.savefig(out / "sim_hit_rate.png", dpi=120)
        plt.close(fig)
    if live is not None:
        fig, axis = plt.subplots(figsize=(6, 4))
        modes = list(live["summary"])
        axis.bar(modes, [live["summary"][m]["follow_up_ttft_s"] for m in modes])
        axis.axhline(0.3 * live["recompute_ttft_s"], color="r", linestyle="--",
                     label="0.3x recompute")
        axis.set_ylabel("follow-up TTFT (s), median")
        axis.set_title(f"Follow-up over an evicted {DOC_TOKENS // 1024}K-token document "
                       f"({live['model']} model, CPU)")
        axis.legend()
        fig.tight_layout()
        fig.savefig(out / "live_ttft.png", dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/kv-tiers"))
    parser.add_argument("--only", choices=("sim", "live"), default=None)
    parser.add_argument("--trace", default="mooncake",
                        help="a shipped trace name or a Mooncake-format JSONL file")
    parser.add_argument("--qps", type=float, default=None, help="default: the trace's own rate")
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--horizon-s", type=float, default=2400.0)
    parser.add_argument("--long-prompt-tokens", type=int, default=32_768)
    parser.add_argument("--host-gib", type=float, nargs="+", default=[1024.0, 2048.0],
                        help="host tier sizes per instance; the first is the node-sized one "
                             "(1 TiB per 8-GPU instance) and gets the disk tier too")
    parser.add_argument("--disk-gib", type=float, default=4096.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-preset", choices=("tiny", "100m"), default="tiny",
                        help="live part: the tiny model, or the 110M-parameter preset (its "
                             "16K-token prefill takes minutes on a CPU)")
    parser.add_argument("--modes", nargs="+", default=["no tier", "host tier", "disk tier"],
                        choices=["no tier", "host tier", "disk tier"],
                        help="live part: which runs ('no tier' is the recompute baseline)")
    args = parser.parse_args(argv)
    if "no tier" not in args.modes:
        parser.error("--modes needs 'no tier': it is the recompute every other run is measured "
                     "against")
    args.out.mkdir(parents=True, exist_ok=True)
    sim = live = None
    if args.only in (None, "sim"):
        sim = run_sim(args)
        (args.out / "sim_results.json").write_text(json.dumps(sim, indent=2) + "\n")
        (args.out / "sim_tables.md").write_text(sim_table(sim))
        print(sim_table(sim))
    if args.only in (None, "live"):
        live = run_live(args)
        (args.out / "live_results.json").write_text(json.dumps(live, indent=2) + "\n")
        print(json.dumps(live["summary"], indent=2))
    plot(sim, live, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
