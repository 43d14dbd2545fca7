"""Building Slipstream's C++ CPU kernels at start-up (``torch.utils.cpp_extension``): with
``-march=native``, into a folder named for this CPU's instruction set, the source and the
PyTorch version, so that a cache shared with another kind of machine is never loaded there."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import torch


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of ``/proc/cpuinfo`` (empty where unreadable or absent)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The instruction-set flags of this CPU (``/proc/cpuinfo``; empty where unreadable)."""
    return _cpuinfo("flags")


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def build(name: str, source: Path, build_dir: Path, cflags: list[str],
          openmp: bool = False) -> None:
    """Compile ``source`` for this CPU into a subfolder of ``build_dir`` (seconds the first
    time, then loaded from there) and load it into the process; its operators register
    themselves. Raises what the compiler or loader raised."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(source.read_bytes() + cpu_flags().encode() + " ".join(cflags).encode()
                            + torch.__version__.encode()).hexdigest()[:12]
    target = build_dir / digest
    target.mkdir(parents=True, exist_ok=True)
    threads = ["-fopenmp"] if openmp else []
    cpp_extension.load(name=name, sources=[str(source)],
                       extra_cflags=["-O3", "-march=native", *threads, *cflags],
                       extra_ldflags=threads, build_directory=str(target),
                       is_python_module=False, verbose=False)
