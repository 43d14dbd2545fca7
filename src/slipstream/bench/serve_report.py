"""Write what ``bench serve`` measured: the metrics JSON, per-request rows and two plots.

    timings + metrics --> DIR/serve.json, DIR/requests.jsonl, DIR/ttft_cdf.png,
                          DIR/ttft_over_time.png
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from slipstream.bench.serve_metrics import RequestTiming


def write_report(out: Path, metrics: dict, timings: list[RequestTiming], config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps({"config": config, "metrics": metrics},
                                               indent=2, default=str) + "\n")
    with (out / "requests.jsonl").open("w") as handle:
        for timing in timings:
            handle.write(json.dumps({
                "scheduled_s": timing.scheduled_s, "send_s": timing.send_s,
                "prompt_tokens": timing.prompt_tokens, "output_tokens": timing.output_tokens,
                "ttft_s": timing.ttft_s, "tpot_s": timing.tpot_s, "e2el_s": timing.e2el_s,
                "success": timing.success, "error": timing.error}) + "\n")
    _plots(out, [t for t in timings if t.success])


def _plots(out: Path, ok: list[RequestTiming]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not ok:
        return
    ttfts = np.sort([t.ttft_s for t in ok])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(9, 3.5))
    sent = [(t.send_s, t.ttft_s) for t in ok if t.ttft_s is not None]
    ax.plot([s for s, _ in sent], [ttft for _, ttft in sent], ".", markersize=3)
    ax.set_xlabel("send time (s)")
    ax.set_ylabel("TTFT (s)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ttft_over_time.png", dpi=110)
    plt.close(fig)
