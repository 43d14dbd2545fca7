"""Where the evaluation data lives, and readers for it.

The real traces and GPU timings sit in ``../shared/data`` next to the repository (see its
README for sources and licences). Benchmarks and the simulator find it by walking up from the
working directory and from this file, so they work from the repository root or any subfolder.
"""

from __future__ import annotations

import csv
from pathlib import Path

SHARED_DATA_PARTS = ("shared", "data")
H100_LLAMA3_8B_TP8 = ("perf", "h100-llama3-8b-tp8")
SHAREGPT_LENGTHS = ("traces", "sharegpt_8k_lengths.csv")


def find_shared_data(*parts: str) -> Path | None:
    """``../shared/data/<parts>`` if it can be found above the cwd or this file, else None."""
    here = Path(__file__).resolve()
    for parent in [Path.cwd(), *Path.cwd().parents, *here.parents]:
        candidate = parent.joinpath(*SHARED_DATA_PARTS, *parts)
        if candidate.exists():
            return candidate
    return None


def read_length_trace(path: Path) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) rows of a vajra/vidur length CSV."""
    with path.open() as handle:
        return [(int(row["num_prefill_tokens"]), int(row["num_decode_tokens"]))
                for row in csv.DictReader(handle)]
