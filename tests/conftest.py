"""Fixtures shared by all test tiers."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (seed 0), written once per test session."""
    from slipstream.agent.engine.tiny_model import write_tiny_model

    model_dir = tmp_path_factory.mktemp("models") / "tiny-llama-seed0"
    write_tiny_model(model_dir, "tiny", seed=0)
    return model_dir
