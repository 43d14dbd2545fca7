"""``slipstream bench``: benchmarks run from the command line. ``bench serve`` is a load
generator for any OpenAI-compatible endpoint (ours, vLLM, SGLang, ...).

    slipstream bench serve --base-url URL --model NAME (workload) [--qps Q] [--burstiness B]
        [--max-concurrency N] [--goodput ttft:MS tpot:MS] [--out DIR]
    --> serve_bench.run_load() --> serve_metrics.serving_metrics() --> JSON on stdout (+ DIR)

Workloads are those of ``slipstream simulate`` (traces, length files, recipes), plus fixed
``--input-len/--output-len``. ``--length-scale`` shrinks lengths for small CPU models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from slipstream.sim.traces import TraceRequest, arrival_times
from slipstream.sim.workloads import RECIPES, WorkloadSpec, build_workload, parse_weighted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    serve = sub.add_parser("serve", help="load an OpenAI-compatible endpoint; vLLM's metrics",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           description=__doc__.split("\n\n")[0])
    add_serve_arguments(serve)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("endpoint")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the API root, ending in /v1")
    target.add_argument("--model", required=True, help="model id the server serves")
    target.add_argument("--api-key", default="unused")
    target.add_argument("--timeout-s", type=float, default=600.0, help="per request")

    work = parser.add_argument_group("workload")
    work.add_argument("--trace", help="azure, mooncake or a trace file (replayed at its times)")
    work.add_argument("--lengths", nargs="+", metavar="NAME[=WEIGHT]",
                      help="length files (sharegpt, arxiv or a path), synthetic arrivals")
    work.add_argument("--recipe", choices=RECIPES)
    work.add_argument("--input-len", type=int, default=None, help="fixed prompt tokens")
    work.add_argument("--output-len", type=int, default=128, help="with --input-len")
    work.add_argument("--num-requests", type=int, default=None)
    work.add_argument("--duration-s", type=float, default=None)
    work.add_argument("--length-scale", type=float, default=1.0,
                      help="multiply prompt and output lengths (small models)")
    work.add_argument("--max-input-len", type=int, default=None, help="clip prompts")
    work.add_argument("--max-output-len", type=int, default=None, help="clip outputs")
    work.add_argument("--max-token-id", type=int, default=1000,
                      help="prompt token ids are drawn below this (must fit the vocabulary)")
    work.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--qps", type=float, default=math.inf,
                      help="mean request rate; inf sends everything at once; a trace is "
                           "rescaled to it (default for traces: their own times)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps (vLLM's meaning): 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)

    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)")
    report.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    report.add_argument("--out", type=Path, default=None, help="directory for JSON and plots")
    report.add_argument("--no-progress", action="store_true")


def serve_workload(args: argparse.Namespace) -> list[TraceRequest]:
    synthetic_qps = 1.0 if math.isinf(args.qps) else args.qps
    if args.input_len is not None:
        count = args.num_requests or 100
        times = arrival_times(np.random.default_rng(args.seed), count,
                              synthetic_qps, args.burstiness).tolist()
        requests = [TraceRequest(at, args.input_len, args.output_len, "fixed") for at in times]
    else:
        trace_qps = None if (args.trace and math.isinf(args.qps)) else synthetic_qps
        requests = build_workload(WorkloadSpec(
            trace=args.trace, lengths=parse_weighted(args.lengths or []), recipe=args.recipe,
            qps=trace_qps, burstiness=args.burstiness, num_requests=args.num_requests,
            duration_s=args.duration_s, seed=args.seed))
    if math.isinf(args.qps) and not args.trace:
        requests = [replace(r, arrival_s=0.0) for r in requests]
    return [_shaped(r, args) for r in requests]


def _shaped(request: TraceRequest, args: argparse.Namespace) -> TraceRequest:
    prompt = max(1, round(request.prompt_tokens * args.length_scale))
    output = max(1, round(request.output_tokens * args.length_scale))
    if args.max_input_len:
        prompt = min(prompt, args.max_input_len)
    if args.max_output_len:
        output = min(output, args.max_output_len)
    return replace(request, prompt_tokens=prompt, output_tokens=output)


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        return run_serve(args)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    from slipstream.bench.serve_bench import LoadConfig, run_load
    from slipstream.bench.serve_metrics import parse_goodput, serving_metrics

    try:
        slos = parse_goodput(args.goodput)
        percentiles = tuple(float(p) for p in args.percentiles.split(","))
        requests = serve_workload(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"slipstream bench serve: {error}", file=sys.stderr)
        return 2
    config = LoadConfig(base_url=args.base_url.rstrip("/"), model=args.model,
                        max_concurrency=args.max_concurrency, max_token_id=args.max_token_id,
                        seed=args.seed, timeout_s=args.timeout_s, api_key=args.api_key,
                        progress=not args.no_progress)
    timings, duration_s = asyncio.run(run_load(requests, config))
    metrics = serving_metrics(timings, duration_s, slos, percentiles)
    errors = sorted({t.error for t in timings if t.error})
    if errors:
        metrics["errors"] = errors[:10]
    print(json.dumps(metrics, indent=2))
    if args.out is not None:
        from slipstream.bench.serve_report import write_report

        settings = {k: v for k, v in vars(args).items() if k != "api_key"}
        write_report(args.out, metrics, timings, settings)
    return 0 if metrics["completed"] else 1
