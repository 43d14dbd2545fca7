"""The plot of ``tenant_flood.py``: victim TTFT per configuration, and its distribution."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np


class FloodRun(Protocol):
    name: str
    victim_ttft_s: list[float]

    def percentile(self, q: float) -> float: ...


def plot(results: Sequence[FloodRun], baseline_s: float, path: Path, goal_ratio: float) -> None:
    """Victim TTFT p50/p99 per configuration against the goal line, and their CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bars, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    names = [result.name for result in results]
    positions = np.arange(len(names))
    for offset, q in ((-0.2, 50), (0.2, 99)):
        bars.bar(positions + offset, [r.percentile(q) * 1000 for r in results], 0.4,
                 label=f"p{q}")
    bars.axhline(baseline_s * goal_ratio * 1000, color="k", linestyle="--",
                 label=f"goal: {goal_ratio}x no-flood p99")
    bars.set_xticks(positions, names, rotation=12, ha="right", fontsize=8)
    bars.set_ylabel("victim TTFT (ms)")
    bars.set_yscale("log")
    bars.legend()
    for result in results:
        values = np.sort(np.asarray(result.victim_ttft_s) * 1000)
        cdf.plot(values, np.arange(1, len(values) + 1) / max(1, len(values)), label=result.name)
    cdf.set_xscale("log")
    cdf.set_xlabel("victim TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.legend()
    figure.suptitle("Short requests of one tenant while another floods slo.ttft_s: 0.001")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
