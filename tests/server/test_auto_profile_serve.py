"""`slipstream serve` without --no-profile, as a real process: the engine core reads the
runtime profile from the cache when there is one, and profiles the engine first when there
is none (the automatic first start, agent/engine/profile/auto_profile.py).

Each test points $XDG_CACHE_HOME at a directory of its own. The hit test fills it the way the
server does (``auto_profile.ensure_profile``, under the key the engine core computes: this
model, dtype and device, ``--engine-threads 1``, the engine version and the grid's name), with
a small grid standing in for the quick one, so filling takes seconds instead of minutes. The
miss test watches the engine core start measuring and stops the server there: the whole quick
grid takes minutes on a loaded 2-core machine, and tests/engine/test_auto_profile.py already
runs it to the end in process and reads the entry back.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from slipstream.bench import local_process
from slipstream.agent.engine.profile import auto_profile, profiler
from slipstream.agent.engine.profile.step_calibration import CalibrationLoad

ENGINE_THREADS = 1  # the core's torch threads, part of the profile's key
# Fills the cache in place of the quick grid (seconds on the tiny model).
SMALL_GRID = profiler.ProfileGrid(
    tokens=(1, 16, 128), prefill_kv=(0, 256), prefill_chunk=(32, 128), decode_batch=(1, 8),
    decode_kv=(256, 1024), calibration_batches=2, calibration_repeats=1,
    engine_load=CalibrationLoad(waves=(1, 3), prompt_tokens=(16, 64), output_tokens=(4, 8)),
    max_point_ms=20.0)
PROFILING_START_TIMEOUT_S = 180.0  # a second interpreter imports torch on a loaded machine
EXIT_TIMEOUT_S = 20.0


def _cache_env(cache_home: Path) -> dict[str, str | None]:
    # $SLIPSTREAM_CACHE_DIR would win over $XDG_CACHE_HOME.
    return {"XDG_CACHE_HOME": str(cache_home), "SLIPSTREAM_CACHE_DIR": None}


def _profiles(cache_home: Path) -> Path:
    return cache_home / "slipstream" / "runtime-profiles"


def _entries(cache_home: Path) -> list[str]:
    """Finished cache entries (not the lock files, not a staging copy)."""
    root = _profiles(cache_home)
    return sorted(path.name for path in root.iterdir()
                  if path.is_dir() and not path.name.endswith(".partial")) \
        if root.exists() else []


def test_a_cached_profile_is_read_by_the_engine_core_without_profiling(
        tiny_model_dir, serve_process, tmp_path, monkeypatch):
    cache_home = tmp_path / "cache"
    monkeypatch.setitem(profiler.PROFILE_GRIDS, auto_profile.GRID, SMALL_GRID)
    entry = auto_profile.ensure_profile(tiny_model_dir, "auto", "cpu", ENGINE_THREADS,
                                        root=_profiles(cache_home))
    monkeypatch.undo()
    written_ns = (entry / "profile.json").stat().st_mtime_ns
    with serve_process(tmp_path, "--engine-threads", str(ENGINE_THREADS), auto_profile=True,
                       env=_cache_env(cache_home)) as server:
        completion = server.openai_client(timeout=60).completions.create(
            model=server.model, prompt="hello", max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True})
        assert completion.usage is not None and completion.usage.completion_tokens == 4
    log = (tmp_path / "serve.log").read_text(errors="replace")
    # The engine core's own line: the entry filled above, read as it was.
    assert f"runtime profile: {entry} (cached; the time-budget packer is on)" in log, log
    assert "first start of" not in log and "ignoring the cached runtime profile" not in log
    assert (entry / "profile.json").stat().st_mtime_ns == written_ns
    assert _entries(cache_home) == [entry.name]


def _wait_for_log(log_path: Path, process: subprocess.Popen, text: str,
                  timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = log_path.read_text(errors="replace")
        if text in log:
            return log
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{log[-4000:]}")
        time.sleep(0.25)
    raise AssertionError(f"{text!r} not in the log within {timeout_s:.0f} s:\n"
                         f"{log_path.read_text(errors='replace')[-4000:]}")


def _exited(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_without_a_cached_profile_the_engine_core_profiles_before_serving(
        tiny_model_dir, serve_argv, tmp_path):
    cache_home = tmp_path / "cache"
    argv, env, port, _ = serve_argv("--engine-threads", str(ENGINE_THREADS), auto_profile=True,
                                    env=_cache_env(cache_home))
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        # The profiler's progress bar: the engine core has started measuring.
        log = _wait_for_log(log_path, process, "profiling:", PROFILING_START_TIMEOUT_S)
        # The core's first-start line, with the thread count its steps will run with.
        assert f"first start of {tiny_model_dir.name} on this device (" in log, log
        assert f", {ENGINE_THREADS} threads): profiling the engine" in log, log
        assert f"into {_profiles(cache_home)}." in log, log
        # Not ready while it measures: the port refuses connections until the engine is up.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        children = psutil.Process(process.pid).children()
        assert any("spawn_main" in " ".join(child.cmdline()) for child in children)
    finally:
        local_process.stop(process)
    # Stopped halfway: the core (and any other child) goes with the server, and nothing is
    # left under the entry's name for a later start to read; it profiles again.
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while not all(_exited(child) for child in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_exited(child) for child in children)
    assert _entries(cache_home) == []
