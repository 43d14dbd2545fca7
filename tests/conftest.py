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
