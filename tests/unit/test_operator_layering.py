"""The import contracts in pyproject.toml (run by `make test` as `lint-imports`) keep the
operator apart from the engine and the web stack. These tests check what the contracts cannot:
that their graph really holds the operator, and that the top-level operator/ folder never
shadows the standard library's `operator`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]


def test_the_import_contracts_see_every_operator_module():
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    graph = grimp.build_graph(*settings["root_packages"],
                              include_external_packages=settings["include_external_packages"])
    on_disk = {f"slipstream.operator.{path.stem}" for path in (REPO / "operator").glob("*.py")}
    assert on_disk and on_disk <= graph.modules
    # ... with their imports, so a forbidden one would break a contract.
    assert graph.direct_import_exists(importer="slipstream.operator.registration", imported="kopf")


def test_stdlib_operator_is_not_shadowed_from_the_repository_root():
    result = subprocess.run([sys.executable, "-c", "import operator; print(operator.__file__)"],
                            cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    assert not result.stdout.strip().startswith(str(REPO)), result.stdout
