"""`make bench` lists the benchmark suite from the Makefile itself and runs one by name."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def make(*args: str) -> str:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args],
                          capture_output=True, text=True, check=True, timeout=60).stdout


def test_make_bench_lists_every_benchmark_with_what_it_measures():
    targets = re.findall(r"^bench-([a-z-]+):", (REPO / "Makefile").read_text(), re.M)
    listed = dict(re.findall(r"^  ([a-z-]+) +(.+)$", make("bench"), re.M))
    assert targets and set(listed) == set(targets)
    assert all(len(text) > 10 for text in listed.values()), listed


def test_make_bench_with_a_name_runs_that_benchmark():
    dry_run = make("-n", "bench", "NAME=sched")
    assert "make --no-print-directory bench-sched" in dry_run
    assert "-m slipstream.bench.sched_bench" in make("-n", "bench-sched")
