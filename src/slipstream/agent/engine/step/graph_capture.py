"""Capturing one CUDA graph the way every static path here does (short prefills, decodes):

    warm-up runs on a side stream (kernel compilation, cuBLAS handles, allocator growth must
    not happen inside the graph) -> capture on the current stream into a shared pool

Graphs of one path never run at the same time, so they share one memory pool; capture the
largest first and the smaller ones reuse its memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

WARMUP_RUNS = 2
Output = TypeVar("Output")


def capture_graph(run: Callable[[], Output], device: torch.device,
                  pool: Any) -> tuple[torch.cuda.CUDAGraph, Output]:
    """``run`` warmed up and captured; returns the graph and what the captured call returned
    (tensors each replay rewrites). ``pool``: ``torch.cuda.graph_pool_handle()``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output
