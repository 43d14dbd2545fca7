"""The evaluation data the package ships: real traces and H100 timings, found by name.

    --trace mooncake | --lengths sharegpt | --profile h100-llama3-8b-tp8
        --data_path()--> <installed package>/sim/data/... (xz-compressed)
        --open_text()--> lines for the trace readers (traces.py); the profile loader reads
                         the .csv.xz tables itself (scheduler/profile_table.py)

The files come from others: sources, licences and what was changed are in ``data/README.md``
next to them, and the licence texts in ``data/LICENSES/``. They travel inside the wheel, so
``slipstream simulate --trace mooncake`` works wherever the package is installed.
"""

from __future__ import annotations

import lzma
from pathlib import Path
from typing import TextIO

DATA_DIR = Path(__file__).resolve().parent / "data"
TRACE_FILES = {
    "azure": "traces/azure2023_conv.csv.xz",
    "mooncake": "traces/mooncake_conversation_trace.jsonl.xz",
    "sharegpt": "traces/sharegpt_8k_lengths.csv.xz",
    "arxiv": "traces/arxiv_summarization_lengths.csv.xz",
}
H100_PROFILE = "h100-llama3-8b-tp8"
H100_LLAMA3_8B_TP8_DIR = DATA_DIR / "perf" / H100_PROFILE


def data_path(name_or_path: str | Path) -> Path:
    """A shipped trace by name (``azure``, ``mooncake``, ``sharegpt``, ``arxiv``), or a file."""
    if isinstance(name_or_path, str) and name_or_path in TRACE_FILES:
        return DATA_DIR / TRACE_FILES[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise FileNotFoundError(f"no such trace file: {path} (shipped traces: "
                                f"{', '.join(TRACE_FILES)})")
    return path


def open_text(path: Path) -> TextIO:
    """A text file, decompressed on the fly when its name ends in ``.xz``."""
    if path.name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def trace_format(path: Path) -> str:
    """``.jsonl`` (Mooncake) or ``.csv`` (Azure or a length file), ignoring compression."""
    name = path.name.removesuffix(".xz")
    return Path(name).suffix
