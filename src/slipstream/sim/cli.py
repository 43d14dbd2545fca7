"""``slipstream simulate``: replay a workload through the real scheduler on a performance model,
once per policy, and report latency, goodput and throughput.

    argv --> WorkloadSpec --> requests;  profile dir --> RuntimePredictor
         --> for each policy: simulate() --> summarize() --> JSON lines on stdout (and --out)
         --> plots (TTFT CDF, short TTFT over time) under --out

Example (Medha's mixed workload on H100 Llama-3-8B TP8, SPP 2)::

    slipstream simulate --recipe medha-mixed --qps 0.5 --duration-s 1800 --spp 2 \
        --policies fcfs@0 edf lrs lars --out results/sim

Length-aware pools (docs/pools.md): ``--pools static|rebalanced --short-instances N
--long-threshold-tokens T`` splits ``--num-instances`` into short and long pools.

Short-prefill batching (PLA-Serve AWD): ``--short-prefill-batching awd`` turns it on for every
run, or a ``+awd`` suffix for one (``--policies fcfs fcfs+awd`` compares the two).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from slipstream.agent.scheduler.config import POLICY_NAMES, PREEMPTION_MODES, SchedulerConfig
from slipstream.agent.scheduler.flags import add_short_prefill_arguments, short_prefill_settings
from slipstream.agent.scheduler.predictor import RuntimePredictor
from slipstream.agent.scheduler.profile_table import VIDUR_H100_LLAMA3_8B_TP8, ProfileMeta
from slipstream.sim.datasets import H100_LLAMA3_8B_TP8_DIR, H100_PROFILE
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.kv_capacity import (
    NVME_GB_PER_S, PCIE_GB_PER_S, estimate_kv_blocks, kv_bytes_per_block)
from slipstream.sim.pools import POOL_MODES, PoolsConfig
from slipstream.sim.simulator import SimConfig, SimResult, simulate
from slipstream.sim.workloads import RECIPES, WorkloadSpec, build_workload, parse_weighted
from slipstream.crds.servingreplica import Rebalance


def add_arguments(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload (one of --trace, --lengths, --recipe)")
    work.add_argument("--trace", help="azure, mooncake, or an Azure-format CSV / Mooncake JSONL")
    work.add_argument("--lengths", nargs="+", metavar="NAME[=WEIGHT]",
                      help="length files (sharegpt, arxiv or a path) with synthetic arrivals; "
                           "several with weights make a mixture")
    work.add_argument("--recipe", choices=RECIPES,
                      help="medha-mixed: ShareGPT lengths + 5%% long (128K-1M) requests; "
                           "sharegpt-short: ShareGPT requests with prompts of <= 256 tokens")
    work.add_argument("--qps", type=float, default=None,
                      help="mean arrival rate; a trace is rescaled to it (default: its own)")
    work.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of synthetic gaps: 1 = Poisson, <1 burstier")
    work.add_argument("--num-requests", type=int, default=None)
    work.add_argument("--output-tokens", type=int, default=None, metavar="N",
                      help="every request generates N tokens (1: a prefill-only instance); "
                           "default: the workload's own output lengths")
    work.add_argument("--duration-s", type=float, default=None, help="arrivals in [0, this)")
    work.add_argument("--seed", type=int, default=0)

    inst = parser.add_argument_group("instances")
    inst.add_argument("--profile", default=H100_PROFILE, metavar="DIR",
                      help=f"profile directory from `slipstream profile`, or {H100_PROFILE} "
                           "(Vidur's H100 tables for Llama-3-8B at TP 8, shipped with the package)")
    inst.add_argument("--num-instances", type=int, default=1)
    inst.add_argument("--tp", type=int, default=None, help="default: the profile's TP")
    inst.add_argument("--spp", type=int, default=1, help="stream pipeline stages")
    inst.add_argument("--kvp", type=int, default=1, help="KV-parallel groups")
    inst.add_argument("--kvp-tokens-per-group", type=int, default=None)
    inst.add_argument("--num-kv-blocks", type=int, default=None,
                      help="16-token KV blocks per instance; default: from --gpu-memory-gib")
    inst.add_argument("--gpu-memory-gib", type=float, default=80.0)
    inst.add_argument("--host-overhead-ms", type=float, default=0.0,
                      help="host time per iteration not in the profile (scheduling, output)")
    tiers = parser.add_argument_group("KV tiers under each instance's GPU prefix cache")
    tiers.add_argument("--kv-host-memory-gib", type=float, default=0.0,
                       help="host memory per instance for evicted KV blocks (a real 8-GPU "
                            "node: 1024); 0: no tiers")
    tiers.add_argument("--kv-disk-gib", type=float, default=0.0,
                       help="disk per instance below the host tier; 0: none")
    tiers.add_argument("--kv-host-gb-per-s", type=float, default=None,
                       help="host -> GPU bandwidth of one GPU; default: the profile's "
                            f"measurement, else {PCIE_GB_PER_S:g} (PCIe 5 x16 in practice); "
                            "an instance loads over all its GPUs' links")
    tiers.add_argument("--kv-disk-gb-per-s", type=float, default=None,
                       help="disk read bandwidth of one instance; default: the profile's "
                            f"measurement, else {NVME_GB_PER_S:g} (two PCIe 4 NVMe drives)")

    pools = parser.add_argument_group("length-aware pools (default: one pool, least backlog)")
    pools.add_argument("--pools", choices=POOL_MODES, default=None,
                       help="static: a fixed short/long split; rebalanced: the operator's "
                            "PLA-Serve rebalancer moves instances between the pools")
    pools.add_argument("--short-instances", type=int, default=None,
                       help="initial short-pool size; None: half the instances, at least 1")
    pools.add_argument("--long-threshold-tokens", type=int, default=None,
                       help="prompts this long or longer go to the long pool; "
                            "None: --long-prompt-tokens")
    pools.add_argument("--rebalance-period-s", type=int, default=30)
    pools.add_argument("--rebalance-cooldown-s", type=int, default=120)
    pools.add_argument("--rebalance-hysteresis", type=float, default=0.2)
    pools.add_argument("--min-per-pool", type=int, default=1)

    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--policies", nargs="+",
                       default=["fcfs@0", "edf", "lrs", "lars-classic", "lars"],
                       metavar="POLICY[@F][+awd]",
                       help=f"policies to compare ({', '.join(POLICY_NAMES)}); @F sets "
                            "max_space_share_fraction for that run (fcfs@0 is plain chunked "
                            "prefill, Medha's baseline); +awd turns on short-prefill batching "
                            "for that run")
    sched.add_argument("--target-batch-time-ms", type=float, default=None,
                       help="default: --slo-tpot-ms if given, else 50")
    sched.add_argument("--max-space-share-fraction", type=float, default=0.5)
    sched.add_argument("--long-request-threshold-tokens", type=int, default=262_144)
    sched.add_argument("--max-num-seqs", type=int, default=256)
    sched.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute")
    add_short_prefill_arguments(parser)

    slo = parser.add_argument_group("SLOs and report")
    slo.add_argument("--slo-ttft-s", type=float, default=None,
                     help="TTFT SLO of short requests (long ones: 1.5x their isolated prefill)")
    slo.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    slo.add_argument("--long-prompt-tokens", type=int, default=8192,
                     help="prompts this long or longer are the long class")
    slo.add_argument("--horizon-s", type=float, default=None,
                     help="stop here; what is not done is reported unfinished")
    slo.add_argument("--out", type=Path, default=None,
                     help="directory for <policy>.json, summary.json and the plots")
    slo.add_argument("--no-progress", action="store_true")


def load_model(profile: str) -> tuple[RuntimePredictor, ProfileMeta]:
    if profile == H100_PROFILE:
        return RuntimePredictor.from_directory(H100_LLAMA3_8B_TP8_DIR,
                                               meta=VIDUR_H100_LLAMA3_8B_TP8), \
            VIDUR_H100_LLAMA3_8B_TP8
    meta_path = Path(profile) / "profile.json"
    meta = ProfileMeta.from_json(json.loads(meta_path.read_text())) if meta_path.exists() \
        else VIDUR_H100_LLAMA3_8B_TP8
    return RuntimePredictor.from_directory(profile, meta=meta), meta


def policy_configs(args: argparse.Namespace) -> list[tuple[str, SchedulerConfig]]:
    target_ms = args.target_batch_time_ms or args.slo_tpot_ms or 50.0
    base = SchedulerConfig(max_num_seqs=args.max_num_seqs, target_batch_time_ms=target_ms,
                           max_space_share_fraction=args.max_space_share_fraction,
                           long_request_threshold_tokens=args.long_request_threshold_tokens,
                           preemption=args.preemption, **short_prefill_settings(args))
    configs = []
    for spec in args.policies:
        spec_without_awd, awd = spec.removesuffix("+awd"), spec.endswith("+awd")
        name, _, share = spec_without_awd.partition("@")
        config = replace(base, policy=name)
        if awd:
            config = replace(config, short_prefill_batching="awd")
        if share:
            config = replace(config, max_space_share_fraction=float(share))
        configs.append((spec, config))
    return configs


def pools_config(args: argparse.Namespace) -> PoolsConfig | None:
    if args.pools is None:
        return None
    short = args.short_instances
    if short is None:
        short = max(1, args.num_instances // 2)
    rebalance = Rebalance(period_seconds=args.rebalance_period_s,
                          cooldown_seconds=args.rebalance_cooldown_s,
                          hysteresis=args.rebalance_hysteresis, min_per_pool=args.min_per_pool)
    return PoolsConfig(mode=args.pools, short_instances=short,
                       long_threshold_tokens=args.long_threshold_tokens or args.long_prompt_tokens,
                       rebalance=rebalance)


def build_sim_config(args: argparse.Namespace, meta: ProfileMeta,
                     scheduler: SchedulerConfig) -> SimConfig:
    tp = args.tp or meta.tp
    if tp != meta.tp:
        raise ValueError(f"the profile was measured at TP {meta.tp}; an instance's TP must match")
    blocks = args.num_kv_blocks or estimate_kv_blocks(meta, tp, args.spp, args.kvp,
                                                      args.gpu_memory_gib)
    instance = InstanceConfig(tp=tp, spp=args.spp, kvp=args.kvp,
                              kvp_tokens_per_group=args.kvp_tokens_per_group,
                              num_kv_blocks=blocks,
                              hidden_size=meta.model.get("hidden_size", 4096),
                              host_overhead_ms=args.host_overhead_ms,
                              **tier_fields(args, meta, tp * args.spp * args.kvp))
    return SimConfig(scheduler=scheduler, instance=instance, num_instances=args.num_instances,
                     num_layers=meta.num_layers, horizon_s=args.horizon_s,
                     short_ttft_slo_s=args.slo_ttft_s, long_prompt_tokens=args.long_prompt_tokens,
                     progress=not args.no_progress, pools=pools_config(args))


def tier_fields(args: argparse.Namespace, meta: ProfileMeta, gpus: int) -> dict:
    """The InstanceConfig fields of ``--kv-host-memory-gib``/``--kv-disk-gib``: sizes in
    blocks of the model's KV (bf16, the whole instance), and bandwidths (measured on the
    profile's device where it did, else PCIe per GPU and NVMe per instance)."""
    if args.kv_host_memory_gib <= 0:
        if args.kv_disk_gib > 0:
            raise ValueError("--kv-disk-gib needs --kv-host-memory-gib (disk blocks are staged "
                             "through host memory)")
        return {}
    block_bytes = kv_bytes_per_block(meta)
    host_gb_per_s = args.kv_host_gb_per_s or meta.host_load_gb_per_s or PCIE_GB_PER_S
    return {"kv_host_blocks": int(args.kv_host_memory_gib * 2**30) // block_bytes,
            "kv_disk_blocks": int(args.kv_disk_gib * 2**30) // block_bytes,
            "kv_bytes_per_block": block_bytes,
            "host_load_gb_per_s": host_gb_per_s * gpus,
            "disk_read_gb_per_s": (args.kv_disk_gb_per_s or meta.disk_read_gb_per_s
                                   or NVME_GB_PER_S)}


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(trace=args.trace, lengths=parse_weighted(args.lengths or []),
                        recipe=args.recipe, qps=args.qps, burstiness=args.burstiness,
                        num_requests=args.num_requests, duration_s=args.duration_s,
                        seed=args.seed, output_tokens=args.output_tokens)


def run(args: argparse.Namespace) -> int:
    from slipstream.sim.plots import short_ttft_over_time, ttft_cdf
    from slipstream.sim.report import summarize

    try:
        spec = workload_spec(args)
        requests = build_workload(spec)
        model, meta = load_model(args.profile)
        configs = [(label, build_sim_config(args, meta, config))
                   for label, config in policy_configs(args)]
    except (ValueError, FileNotFoundError, ValidationError) as error:
        print(f"slipstream simulate: {error}", file=sys.stderr)
        return 2
    results: dict[str, SimResult] = {}
    summaries = []
    for label, config in configs:
        result = simulate(requests, config, model)
        results[label] = result
        summary = {"label": label, **summarize(result, args.long_prompt_tokens, args.slo_tpot_ms)}
        if config.pools is not None:
            summary["pools"] = {"mode": config.pools.mode,
                                "short_instances": config.pools.short_instances,
                                "long_threshold_tokens": config.pools.long_threshold_tokens,
                                "final": result.final_pools, "moves": result.pool_moves}
        summaries.append(summary)
        print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for summary in summaries:
            name = summary["label"].replace("@", "-ss")
            (args.out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
        (args.out / "summary.json").write_text(json.dumps(
            {"workload": vars(spec) | {"lengths": list(spec.lengths)},
             "results": summaries}, indent=2, default=str) + "\n")
        if importlib.util.find_spec("matplotlib") is None:
            print("slipstream simulate: no plots without matplotlib (it comes with the agent "
                  "extra: pip install 'slipstream[agent]')", file=sys.stderr)
            return 0
        ttft_cdf(results, args.out / "ttft_cdf.png", args.long_prompt_tokens)
        short_ttft_over_time(results, args.out / "short_ttft_over_time.png",
                             args.long_prompt_tokens)
    return 0
