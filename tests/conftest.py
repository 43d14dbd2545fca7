"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama written by `slipstream make-tiny-model`, once per session."""
    from slipstream.cli import main

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    assert main(["make-tiny-model", str(path), "--seed", "0"]) == 0
    return path


@pytest.fixture(scope="session")
def chart_inventory():
    """``charts/dashgen/inventory.py``: the chart's dashboard queries and alert rules, read back.
    dashgen lives beside the chart, outside the ``slipstream`` package."""
    import importlib
    import sys

    charts_dir = str(Path(__file__).resolve().parent.parent / "charts")
    if charts_dir not in sys.path:
        sys.path.insert(0, charts_dir)
    return importlib.import_module("dashgen.inventory")
