"""Engine-tier test setup: tests marked ``gpu`` are skipped on machines without CUDA (where
Triton kernels run in its interpreter: see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: no CUDA device on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
