"""A CPU engine process keeps its freed step temporaries mapped (step/cpu_heap.py): a step that
allocates and frees the same large buffers again takes no new pages from the kernel.

Each case runs in a fresh interpreter, from glibc's starting thresholds, and counts the minor
page faults of the repeated steps."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# Four 4 MiB buffers alive at once, freed together: a decode step's gathered keys and values.
STEPS = """
import ctypes, ctypes.util, resource, sys, torch
from pathlib import Path
from slipstream.agent.engine.step.cpu_heap import keep_step_buffers_mapped
# glibc's starting thresholds (128 KiB), held: where its adaptation stands depends on what
# the process freed before, and on the address layout, so without this the default case
# only sometimes pays.
mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
assert mallopt(-3, 128 << 10) and mallopt(-1, 128 << 10)
mode = sys.argv[1]
if mode == "kept":
    assert keep_step_buffers_mapped()
elif mode == "runner":
    from slipstream.agent.engine.config import EngineConfig, ModelConfig
    from slipstream.agent.engine.step.model_runner import ModelRunner
    model_dir = Path(sys.argv[2])
    ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=16),
                ModelConfig.from_dir(model_dir))
def step():
    buffers = [torch.ones(1 << 20) for _ in range(4)]
    del buffers
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
"""
PAGES_PER_STEP = 4 * (4 << 20) // 4096


def faults_per_step(*args: str) -> float:
    done = subprocess.run([sys.executable, "-c", STEPS, *args], capture_output=True,
                          text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def test_repeated_step_buffers_take_no_new_pages():
    # Under glibc's starting thresholds each buffer is mapped and unmapped again, and every
    # step faults its pages in again.
    assert faults_per_step("default") > PAGES_PER_STEP / 4
    assert faults_per_step("kept") < PAGES_PER_STEP / 100


def test_a_cpu_model_runner_keeps_its_step_buffers(tiny_model_dir):
    assert faults_per_step("runner", str(tiny_model_dir)) < PAGES_PER_STEP / 100
