"""The device check's first stages: what the machine is (versions, copy bandwidth, matmul
throughput) and the GPU-marked tests run under pytest with their JUnit counts."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[3]  # the checkout: src/slipstream/bench/ is three down


def environment(device: str) -> dict:
    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__,
                  "device": device, "host": platform.machine()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device != "cuda":
        info["chip"] = f"CPU ({os.cpu_count()} cores)"
        info["copy_gb_per_s"] = _copy_bandwidth_gb_per_s(torch.device("cpu"), 2**26)
        return info
    properties = torch.cuda.get_device_properties(0)
    info.update(chip=properties.name, multiprocessors=properties.multi_processor_count,
                memory_gib=round(properties.total_memory / 2**30, 1),
                cuda=torch.version.cuda,
                copy_gb_per_s=_copy_bandwidth_gb_per_s(torch.device("cuda"), 2**31),
                bf16_matmul_tflops=_matmul_tflops())
    return info


def _copy_bandwidth_gb_per_s(device, num_bytes: int, repeats: int = 10) -> float:
    """A device-to-device copy, counting the bytes read and the bytes written (the usual
    convention for a copy's bandwidth); the median of ``repeats``."""
    import torch

    source = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 2):
        started = _now(device)
        target.copy_(source)
        times.append(_now(device) - started)
    return round(2 * num_bytes / float(np.median(times[2:])) / 1e9, 1)


def _matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(repeats + 3):
        started = _now("cuda")
        a @ b
        times.append(_now("cuda") - started)
    return round(2 * size**3 / float(np.median(times[3:])) / 1e12, 1)


def _now(device) -> float:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def run_pytest(arguments: list[str], timeout_s: float, log: Path) -> dict:
    """pytest in a subprocess with a wall-clock limit: counts and failing test ids from its
    JUnit report (what it finished, when it timed out)."""
    if timeout_s < 20:
        return {"skipped": f"{timeout_s:.0f} s left, not enough to start"}
    junit = log.with_suffix(".xml")
    command = [sys.executable, "-m", "pytest", *arguments, "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    started = time.monotonic()
    with open(log, "wb") as output:
        try:
            process = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                     timeout=timeout_s, check=False)
            returncode: int | None = process.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    result = {"command": " ".join(command[2:]), "returncode": returncode,
              "timed_out": returncode is None,
              "duration_s": round(time.monotonic() - started, 1)}
    result.update(junit_counts(junit))
    junit.unlink(missing_ok=True)  # its counts are in the result; the log stays
    return result


def junit_counts(path: Path) -> dict:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {"report": "none (pytest did not finish writing it)"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[str] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failures.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures[:40]}
