"""Engine-tier test setup: tests marked ``gpu`` are skipped on machines without CUDA, and
without CUDA Triton kernels run in Triton's interpreter (set before anything imports a
kernel: ``triton.jit`` reads it when a kernel is defined)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
