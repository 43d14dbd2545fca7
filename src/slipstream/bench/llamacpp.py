"""llama.cpp's ``llama-server`` and ``llama-quantize``, built once from the source that the
``llama-cpp-python`` sdist ships (its ``vendor/llama.cpp``), for the peer benchmark only.

    pip download --no-binary :all: llama-cpp-python==VERSION  (the sdist, through PyPI)
        -> vendor/llama.cpp -> cmake (Release, CPU, native) -> llama-server, llama-quantize
        -> $SLIPSTREAM_CACHE_DIR/llama.cpp/<VERSION>/bin/

The build takes about 10 minutes on 2 cores and is never part of ``make test``.
``python -m slipstream.bench.llamacpp`` builds it (or says where it already is).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
from slipstream.bench.local_process import ExitedDuringStartup, running

logger = logging.getLogger(__name__)

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-quantize")


def bin_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return slipstream_cache_dir() / "llama.cpp" / version / "bin"


def ensure_built(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None) -> Path:
    """The directory holding the built binaries, building them on first use."""
    target = bin_dir(version)
    if all((target / name).is_file() for name in TARGETS):
        return target
    work = Path(tempfile.mkdtemp(prefix="llama-cpp-build-"))
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", str(work)],
                       check=True)
        [sdist] = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        [source] = work.glob("llama_cpp_python-*/vendor/llama.cpp")
        build = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator,
                        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS, "-j",
                        str(jobs or os.cpu_count() or 1)], check=True)
        target.mkdir(parents=True, exist_ok=True)
        for name in TARGETS:
            [binary] = [path for path in build.rglob(name) if path.is_file()
                        and os.access(path, os.X_OK)]
            shutil.copy2(binary, target / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


# llama.cpp repacks Q4_0/Q4_1/Q8_0 weights for its AMX matmuls on CPUs with AMX-INT8, and
# those crash (SIGSEGV in ggml_backend_amx_mul_mat) at the first inference on some
# Sapphire-Rapids-class machines (ggml-org/llama.cpp#20824, closed as stale without a fix).
# Where llama-server dies so during start-up, it starts again with --no-repack (no extra
# buffer types: its AVX-512 dot products), and the caller is told.
NO_REPACK = "--no-repack"


@contextlib.contextmanager
def llama_server(argv: list[str], log: Path, ready_url: str, *,
                 env: dict[str, str] | None = None, timeout_s: float = 300.0
                 ) -> Iterator[list[str]]:
    """``llama-server`` (``argv``) running and answering ``ready_url``; yields the arguments it
    runs with: ``argv``, or ``argv`` plus ``--no-repack`` where its AMX path crashed."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(running(argv, log, ready_url, env=env, timeout_s=timeout_s))
        except ExitedDuringStartup as error:
            if error.returncode != -signal.SIGSEGV or NO_REPACK in argv:
                raise
            crash_log = log.with_suffix(".crash.log")
            shutil.copyfile(log, crash_log)
            logger.warning("llama-server crashed during start-up (SIGSEGV; its AMX matmuls "
                               "on this CPU, ggml-org/llama.cpp#20824); starting it again with "
                               "%s, its log in %s", NO_REPACK, crash_log.name)
            argv = [*argv, NO_REPACK]
            stack.enter_context(running(argv, log, ready_url, env=env, timeout_s=timeout_s))
        yield argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION,
                        help="llama-cpp-python sdist version whose llama.cpp is built")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    args = parser.parse_args(argv)
    print(ensure_built(args.version, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
