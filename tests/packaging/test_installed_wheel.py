"""The package as a user gets it: a wheel built from this checkout, installed into a fresh
virtualenv outside the repository with no extras (no torch, no web stack), runs
``slipstream simulate --trace mooncake`` on the traces and H100 tables it carries.

The install resolves the core dependencies (numpy, pydantic, pyyaml, tqdm) through pip as
usual; nothing here reads the checkout once the wheel is built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL_LIMIT_BYTES = 5 * 1024 * 1024


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout_s: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout_s)
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_simulate_runs_from_an_installed_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    had_build_dir = (REPO / "build").exists()
    try:
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps",
              "--quiet", "--wheel-dir", str(wheels), str(REPO)], cwd=tmp_path)
    finally:
        if not had_build_dir:  # setuptools builds in the source tree; leave it as it was
            shutil.rmtree(REPO / "build", ignore_errors=True)
    (wheel,) = wheels.glob("slipstream-*.whl")
    assert wheel.stat().st_size < WHEEL_LIMIT_BYTES
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "slipstream/sim/data/traces/mooncake_conversation_trace.jsonl.xz" in names
    assert "slipstream/sim/data/README.md" in names  # sources and licences travel along

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          str(wheel)], cwd=tmp_path)

    # Outside the repository, with a clean environment: no PYTHONPATH, a fresh home (the
    # profile cache goes there), and nothing from the test's own virtualenv on PATH.
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(home),
           "LANG": os.environ.get("LANG", "C.UTF-8")}
    result = _run([str(env_dir / "bin" / "slipstream"), "simulate", "--trace", "mooncake",
                   "--duration-s", "60", "--policies", "fcfs", "lars", "--no-progress",
                   "--out", "sim"], cwd=home, env=env)
    assert (home / "sim" / "summary.json").exists()
    assert "no plots without matplotlib" in result.stderr
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [s["label"] for s in summaries] == ["fcfs", "lars"]
    for summary in summaries:
        assert summary["requests"] > 100  # about 2.6 requests/s in the trace's first minute
        assert summary["completed"] == summary["requests"]
        assert summary["overall"]["ttft_s"]["p50"] > 0

    # It was the installed copy that ran, in an environment without the agent's extras.
    installed = _run([str(python), "-c", "import importlib.util, slipstream; "
                      "print(slipstream.__file__); print(importlib.util.find_spec('torch'))"],
                     cwd=home, env=env).stdout.splitlines()
    assert installed[0].startswith(str(env_dir)), installed
    assert installed[1] == "None"
