"""What the operator process loads, checked in a fresh interpreter: never the engine (torch) or
the web stack, and the pure modules not even the API client, kopf or gRPC. (import-linter
cannot see slipstream.operator: the top-level operator/ folder must stay a namespace package
so that it never shadows the standard library's `operator`.)"""

from __future__ import annotations

import json
import subprocess
import sys

PURE = ["slipstream.operator.builders", "slipstream.operator.placement",
        "slipstream.operator.instances", "slipstream.operator.status",
        "slipstream.operator.rebalancer", "slipstream.operator.capacity",
        "slipstream.operator.naming", "slipstream.crds.servingreplica",
        "slipstream.crds.generate"]
OPERATOR = ["slipstream.operator.cli", "slipstream.operator.registration"]


def loaded_after_importing(modules: list[str]) -> set[str]:
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    return set(json.loads(result.stdout))


def top_level(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_operator_process_never_loads_the_engine_or_web_stack():
    loaded = loaded_after_importing(OPERATOR)
    assert not top_level(loaded) & {"torch", "fastapi", "starlette", "uvicorn", "zmq"}
    # The pure scheduler package is fine (the CRD takes its policy names from it).
    assert not {m for m in loaded if m.startswith(("slipstream.agent.engine",
                                                   "slipstream.agent.parallel",
                                                   "slipstream.kernels"))}
    assert "kopf" in top_level(loaded), "the check must have imported the real thing"


def test_pure_operator_modules_load_no_api_client():
    loaded = loaded_after_importing(PURE)
    assert not top_level(loaded) & {"kopf", "kubernetes", "grpc", "torch"}


def test_stdlib_operator_is_not_shadowed_from_the_repository_root():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", "import operator; print(operator.__file__)"],
                            cwd=repo, capture_output=True, text=True, check=True, timeout=60)
    assert not result.stdout.strip().startswith(str(repo)), result.stdout
