"""LARS against FCFS on the live engine: short-request TTFT when a few long prompts arrive.

The two systems are the ones Medha compares: FCFS is plain chunked prefill in arrival order
(no space sharing: a long prefill takes the whole budget), LARS is Medha's scheduler (least
relative slack first, and a long prefill yields up to half the budget to short ones). The
long-request threshold is scaled to the tiny CPU model (``--long-threshold-tokens``), since the
production default of 256K tokens is beyond what a CPU prefills in seconds.

One workload, replayed in real time against a fresh engine per policy, in one run:
  * mostly short requests (prompt and output lengths drawn from the ShareGPT length trace the
    simulator ships, scaled down to the tiny model), Poisson arrivals;
  * a few long prompts, each taking seconds to prefill on this CPU;
  * an arrival rate set to ``--load`` times the engine's measured burst capacity for short
    requests (burst capacity overstates what Poisson arrivals sustain, hence the low default).

The engine is the real one (model, paged KV, scheduler, sampler); only the HTTP layer is left
out, so that client noise does not blur the scheduler's effect. TTFT is measured from each
request's scheduled arrival time. Writes ``policy_live.json``, ``policy_live.png`` and
``policy_live_table.md`` (the table docs/scheduling.md shows, with the live goals checked)::

    python -m slipstream.bench.policy_live_bench --out results/policy-live
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.kv.memory import KVCacheMemory
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.profile.profiler import PROFILE_GRIDS, profile
from slipstream.contracts.sampling import SamplingParams
from slipstream.bench.sim_policies import source_version
from slipstream.agent.engine.models.tiny_model import ensure_default_model
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.sim.datasets import data_path
from slipstream.sim.traces import read_length_file



@dataclass(frozen=True)
class Arrival:
    request_id: str
    at_s: float
    prompt: list[int]
    max_tokens: int
    is_long: bool


def short_lengths(rng: np.random.Generator, count: int, scale: float) -> list[tuple[int, int]]:
    """(prompt, output) lengths from the ShareGPT trace, scaled."""
    rows = read_length_file(data_path("sharegpt"))
    picks = rng.choice(len(rows), count)
    return [(max(8, int(rows[i][0] * scale)), max(4, min(48, int(rows[i][1] * scale))))
            for i in picks]


def build_workload(rng: np.random.Generator, rate_per_s: float, duration_s: float,
                   long_count: int, long_tokens: int, scale: float, vocab: int) -> list[Arrival]:
    arrivals, now, index = [], 0.0, 0
    count = int(rate_per_s * duration_s * 1.2) + 1
    lengths = short_lengths(rng, count, scale)
    while now < duration_s and index < len(lengths):
        now += float(rng.exponential(1.0 / rate_per_s))
        prompt_len, output_len = lengths[index]
        arrivals.append(Arrival(f"short-{index}", now, rng.integers(10, vocab - 300,
                                prompt_len).tolist(), output_len, False))
        index += 1
    # Long prompts land in the first half, so short requests keep arriving behind them.
    for i, at in enumerate(np.linspace(0.1, 0.5, long_count) * duration_s):
        arrivals.append(Arrival(f"long-{i}", float(at), rng.integers(10, vocab - 300,
                                long_tokens).tolist(), 8, True))
    return sorted(arrivals, key=lambda a: a.at_s)


TARGET_BATCH_MS = 50.0
SYSTEMS = {  # name -> (policy, max_space_share_fraction)
    "fcfs": ("fcfs", 0.0),
    "lars": ("lars", 0.5),  # Slipstream's (short lane, late reserve; space sharing unused)
    "lars-classic": ("lars-classic", 0.5),  # Medha's
    "edf": ("edf", 0.5),
    "fcfs+space-sharing": ("fcfs", 0.5),
}


def make_engine(model_dir: Path, profile_dir: Path, system: str,
                long_threshold_tokens: int) -> LLMEngine:
    policy, space_share = SYSTEMS[system]
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", profile_dir=profile_dir,
                                  kv_cache_memory=KVCacheMemory(size_bytes=2**30)),
                     SchedulerConfig(policy=policy, target_batch_time_ms=TARGET_BATCH_MS,
                                     max_space_share_fraction=space_share,
                                     long_request_threshold_tokens=long_threshold_tokens))


def replay(engine: LLMEngine, arrivals: list[Arrival], label: str,
           steps: list[tuple[float, float | None, float]] | None = None) -> dict[str, dict]:
    """Feed arrivals at their times; returns per-request TTFT/E2E in seconds.

    ``steps`` collects (start s, predicted s, actual execute s) per engine step, which shows
    whether a slow stretch was the scheduler's choice or a step taking longer than predicted.
    """
    by_id = {a.request_id: a for a in arrivals}
    records: dict[str, dict] = {}
    deadlines: dict[str, float] = {}  # TTFT deadline after arrival, as the scheduler set it
    pending = list(arrivals)
    start = time.monotonic()
    if steps is not None:
        engine.on_step = lambda step: steps.append((step.execute_start_s - start,
                                                    step.batch.predicted_time_s, step.execute_s))
    with tqdm(total=len(arrivals), desc=label, unit="req") as progress:
        while pending or engine.has_unfinished():
            now = time.monotonic() - start
            while pending and pending[0].at_s <= now:
                arrival = pending.pop(0)
                engine.add_request(arrival.prompt, SamplingParams(
                    max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True),
                    arrival.request_id)
                request = engine.scheduler.requests[arrival.request_id]
                assert request.ttft_deadline_s is not None, "the scheduler sets it on add"
                deadlines[arrival.request_id] = request.ttft_deadline_s - request.arrival_s
            if not engine.has_unfinished():
                time.sleep(max(0.0, pending[0].at_s - now))
                continue
            for output in engine.step():
                at = time.monotonic() - start
                record = records.setdefault(output.request_id, {})
                record.setdefault("ttft_s", at - by_id[output.request_id].at_s)
                if output.finished:
                    record["e2e_s"] = at - by_id[output.request_id].at_s
                    record["arrival_s"] = by_id[output.request_id].at_s
                    record["long"] = by_id[output.request_id].is_long
                    record["deadline_s"] = deadlines[output.request_id]
                    progress.update()
    return records


def measure_capacity(model_dir: Path, profile_dir: Path, rng: np.random.Generator,
                     scale: float, vocab: int) -> float:
    """Short requests per second the engine completes when they all arrive at once."""
    engine = make_engine(model_dir, profile_dir, "fcfs", 1 << 30)
    lengths = short_lengths(rng, 96, scale)
    params = [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
              for _, out in lengths]
    prompts = [rng.integers(10, vocab - 300, p).tolist() for p, _ in lengths]
    started = time.monotonic()
    for prompt, param in zip(prompts, params):
        engine.add_request(prompt, param)
    while engine.has_unfinished():
        engine.step()
    return len(prompts) / (time.monotonic() - started)


def summarize(records: dict[str, dict], duration_s: float) -> dict:
    """TTFT percentiles, and SLO goodput as the simulator counts it: requests whose first
    token came within the TTFT deadline the scheduler gave them (max(1.5 x predicted prefill,
    0.5 s) by default), per second of the workload."""
    short = [r["ttft_s"] for r in records.values() if not r["long"]]
    long = [r for r in records.values() if r["long"]]
    met = sum(r["ttft_s"] <= r["deadline_s"] for r in records.values())
    return {"goodput_rps": met / duration_s, "slo_attained": met, "requests": len(records),
            "short_ttft_p50_s": float(np.percentile(short, 50)),
            "short_ttft_p99_s": float(np.percentile(short, 99)),
            "short_ttft_mean_s": float(np.mean(short)), "short_completed": len(short),
            "long_completed": len(long), "long_e2e_s": [r["e2e_s"] for r in long],
            "long_ttft_s": [r["ttft_s"] for r in long]}


def table(summary: dict, settings: dict) -> str:
    """The markdown table docs/scheduling.md takes, with the issue's live goals checked."""
    lines = [f"Live CPU engine (tiny model), {settings['duration_s']:g} s workload, "
             f"{settings['requests']} requests at {settings['rate_req_per_s']:.2f} req/s; "
             f"commit {settings.get('commit') or 'unknown'}; load average before "
             f"{settings['load_average_before'][0]:.1f}, after {settings['load_average_after'][0]:.1f}.",
             "",
             "| policy | goodput (req/s) | SLO met | short TTFT p50 (s) | short TTFT p99 (s) | "
             "long TTFT max (s) |", "|---|---|---|---|---|---|"]
    policies = [name for name in summary if isinstance(summary[name], dict)]
    for name in policies:
        row = summary[name]
        long_ttft = max(row["long_ttft_s"], default=float("nan"))
        lines.append(f"| {name} | {row['goodput_rps']:.3f} | {row['slo_attained']}/"
                     f"{row['requests']} | {row['short_ttft_p50_s']:.3f} | "
                     f"{row['short_ttft_p99_s']:.3f} | {long_ttft:.2f} |")
    overhead_ms = settings.get("profile_step_overhead_ms", 0.0)
    if overhead_ms >= TARGET_BATCH_MS:
        lines += ["", f"**Not valid:** the profile predicts {overhead_ms:.0f} ms of overhead per "
                      f"step, over the {TARGET_BATCH_MS:g} ms target (measured under load)."]
    order = sorted(policies, key=lambda name: -summary[name]["goodput_rps"])
    lines += ["", "Goodput order: " + " > ".join(order) + "."]
    if "lars_p50_over_edf_x" in summary:
        lines.append(f"lars short TTFT p50: {summary['lars_p50_over_edf_x']:.2f}x EDF's "
                     f"(goal <= 2).")
    if "lars_p99_improvement_x" in summary:
        lines.append(f"lars short TTFT p99: {summary['lars_p99_improvement_x']:.1f}x better "
                     f"than FCFS's (goal >= 10).")
    return "\n".join(lines) + "\n"


def step_accuracy(steps: list[tuple[float, float | None, float]]) -> dict:
    """How the executed steps compared with the predictor the packer budgets with."""
    ratios = np.array([actual / predicted for _, predicted, actual in steps
                       if predicted is not None and predicted > 0])
    actual = np.array([a for _, _, a in steps])
    return {"steps": len(steps), "step_p50_ms": float(np.percentile(actual, 50) * 1000),
            "step_max_ms": float(actual.max() * 1000),
            "step_actual_over_predicted_p50": float(np.percentile(ratios, 50)),
            "step_actual_over_predicted_p99": float(np.percentile(ratios, 99)),
            "steps_over_2x_predicted": int((ratios > 2).sum())}


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, timeline) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, records in results.items():
        short = sorted(r["ttft_s"] for r in records.values() if not r["long"])
        cdf.plot(short, np.arange(1, len(short) + 1) / len(short), label=policy)
        points = sorted((r["arrival_s"], r["ttft_s"]) for r in records.values() if not r["long"])
        timeline.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=3,
                      label=policy)
    cdf.set_xscale("log")
    cdf.set_xlabel("short-request TTFT (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.legend()
    timeline.set_yscale("log")
    timeline.set_xlabel("arrival time (s)")
    timeline.set_ylabel("short-request TTFT (s)")
    timeline.set_title("convoys show as spikes")
    timeline.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/policy-live"))
    parser.add_argument("--systems", default="fcfs,lars",
                        help=f"comma-separated, from {sorted(SYSTEMS)}")
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--load", type=float, default=0.25,
                        help="short-request arrival rate as a fraction of measured capacity")
    parser.add_argument("--long-count", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=24_000)
    parser.add_argument("--long-threshold-tokens", type=int, default=4096,
                        help="processed KV at which a prefill counts as long (space sharing)")
    parser.add_argument("--length-scale", type=float, default=0.1,
                        help="ShareGPT lengths are multiplied by this for the tiny CPU model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None,
                        help="reuse this profile directory; by default the engine is profiled "
                             "afresh into OUT/profile, so the profile always matches the code")
    parser.add_argument("--profile-grid", choices=sorted(PROFILE_GRIDS), default="full",
                        help="grid of the fresh profile ('small' takes a few minutes)")
    parser.add_argument("--profile-repeats", type=int, default=7,
                        help="timed runs per grid point of the fresh profile")
    args = parser.parse_args(argv)
    bench_started = time.monotonic()
    model_dir = ensure_default_model()
    profile_dir = args.profile
    if profile_dir is None:
        started = time.monotonic()
        profile_dir = profile(model_dir, "cpu", args.out / "profile", args.profile_repeats,
                              PROFILE_GRIDS[args.profile_grid])
        print(f"profiled in {time.monotonic() - started:.0f} s", flush=True)
    meta = json.loads((profile_dir / "profile.json").read_text())
    overhead_ms = meta.get("iteration_overhead_ms", 0.0) + meta.get("per_sequence_overhead_ms", 0.0)
    if overhead_ms >= TARGET_BATCH_MS:
        print(f"WARNING: the profile predicts {overhead_ms:.0f} ms of overhead for a one-sequence "
              f"step, over the {TARGET_BATCH_MS:g} ms target: it was measured on a loaded "
              f"machine, and every batch will be packed as over budget", flush=True)
    load_before = os.getloadavg()
    rng = np.random.default_rng(args.seed)
    vocab = 4096
    started = time.monotonic()
    capacity = measure_capacity(model_dir, profile_dir, rng, args.length_scale, vocab)
    print(f"capacity {capacity:.2f} short req/s, measured in {time.monotonic() - started:.0f} s",
          flush=True)
    rate = args.load * capacity
    arrivals = build_workload(rng, rate, args.duration_s, args.long_count, args.long_tokens,
                              args.length_scale, vocab)
    results: dict[str, dict[str, dict]] = {}
    step_logs: dict[str, list[tuple[float, float | None, float]]] = {}
    for system in args.systems.split(","):
        engine = make_engine(model_dir, profile_dir, system, args.long_threshold_tokens)
        step_logs[system] = []
        started = time.monotonic()
        results[system] = replay(engine, arrivals, system, step_logs[system])
        print(f"{system}: replayed in {time.monotonic() - started:.0f} s", flush=True)
    summary = {policy: summarize(records, args.duration_s) | step_accuracy(step_logs[policy])
               for policy, records in results.items()}
    if "fcfs" in summary and "lars" in summary:
        summary["lars_p99_improvement_x"] = (summary["fcfs"]["short_ttft_p99_s"]
                                             / summary["lars"]["short_ttft_p99_s"])
    if "edf" in summary and "lars" in summary:
        summary["lars_p50_over_edf_x"] = (summary["lars"]["short_ttft_p50_s"]
                                          / summary["edf"]["short_ttft_p50_s"])
    report = {"settings": {**{k: v for k, v in vars(args).items() if k != "out"},
                           "commit": source_version()["commit"],
                           "capacity_req_per_s": capacity, "rate_req_per_s": rate,
                           "requests": len(arrivals), "profile": str(profile_dir),
                           "load_average_before": list(load_before),
                           "load_average_after": list(os.getloadavg()),
                           "profile_step_overhead_ms": overhead_ms,
                           "wall_s": time.monotonic() - bench_started},
              "summary": summary, "requests": results, "steps": step_logs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_live.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "policy_live.png")
    (args.out / "policy_live_table.md").write_text(table(summary, report["settings"]))
    print(json.dumps({"settings": report["settings"], "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
