"""Figures of a simulation: TTFT CDF per policy (as Medha Fig. 13) and short-request TTFT over
time (as Medha Fig. 1b, where a convoy behind a long prefill shows as a spike).

    {label: SimResult} --> ttft_cdf() / short_ttft_over_time() --> PNG files

matplotlib is imported here only, with the file-only Agg backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slipstream.sim.report import short_ttft_series, ttft_values
from slipstream.sim.simulator import SimResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(results: dict[str, SimResult], path: Path, long_prompt_tokens: int,
             title: str = "") -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, which in zip(axes, ("short", "all")):
        for label, result in results.items():
            values = np.sort(ttft_values(result, which, long_prompt_tokens))
            if values.size == 0:
                continue
            total = sum(1 for r in result.records if which == "all"
                        or r.prompt_tokens < long_prompt_tokens)
            # Requests without a first token stay off the curve, so it ends below 1.
            ax.step(values, np.arange(1, values.size + 1) / total, where="post", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_title(f"{which} requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[1].legend(fontsize=8)
    fig.suptitle(title or "TTFT CDF per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def short_ttft_over_time(results: dict[str, SimResult], path: Path, long_prompt_tokens: int,
                         title: str = "") -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 * len(results) + 0.6),
                             sharex=True, sharey=True, squeeze=False)
    for ax, (label, result) in zip(axes[:, 0], results.items()):
        arrivals, ttfts = short_ttft_series(result, long_prompt_tokens)
        ax.plot(arrivals, ttfts, ".", markersize=2)
        long_arrivals = [r.arrival_s for r in result.records
                         if r.prompt_tokens >= long_prompt_tokens]
        for at in long_arrivals:
            ax.axvline(at, color="red", alpha=0.25, linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{label}: short requests (red lines: long arrivals)", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("arrival time (s)")
    fig.suptitle(title or "Short-request TTFT over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
