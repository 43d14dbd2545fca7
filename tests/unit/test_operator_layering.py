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


def test_the_checkout_holds_real_files_that_an_import_tool_can_read():
    # The code lives under src/slipstream; the top-level folders are links into it. A tool
    # that walks the checkout's package (pydeps, grimp on a source tree) must meet files, not
    # links that it may decline to follow.
    package = REPO / "src" / "slipstream"
    links = [path for path in package.rglob("*") if path.is_symlink()]
    assert not links, links
    for name in ("agent", "operator", "kernels", "crds", "decisions"):
        top = REPO / name
        assert top.is_symlink() and top.resolve() == package / name
    # The graph between the top-level folders, read from the real files, has the arrows the
    # layering contracts are about (agent -> kernels, operator -> crds, ...), not two.
    graph = grimp.build_graph("slipstream", "slipstream.operator")
    folders = {"agent", "operator", "kernels", "crds", "decisions"}

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in folders else None

    arrows = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = folder(importer), folder(imported)
            if a and b and a != b:
                arrows.add((a, b))
    assert {("agent", "kernels"), ("operator", "crds"), ("operator", "decisions")} <= arrows


def test_no_module_of_the_agent_operator_or_decisions_exceeds_400_lines():
    # A module a newcomer can read in one sitting (issue 29's layout); split by responsibility.
    package = REPO / "src" / "slipstream"
    long = {str(path.relative_to(package)): count
            for folder in ("agent", "operator", "decisions")
            for path in (package / folder).rglob("*.py")
            if (count := len(path.read_text().splitlines())) > 400}
    assert not long, long
