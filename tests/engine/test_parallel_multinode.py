"""The multi-node launch path, on one machine: the controller starts only its own ranks and
a separate ``slipstream worker`` process (another "node") starts the rest, both configured
by the environment variables the operator sets. Output equals the single-process engine."""

from __future__ import annotations

import os
import subprocess
import sys

from slipstream.agent.engine.config import EngineConfig
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.parallel.compose import build_engine
from slipstream.agent.parallel.launch import free_port

PROMPTS = [[(13 * i + 5 * j + 1) % 4000 for j in range(30 + 25 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)



def _generate(model_dir, parallel: ParallelConfig) -> list[list[int]]:
    engine = build_engine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64,
                                       parallel=parallel))
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.close()


def test_controller_node_and_worker_node_from_environment(tiny_model_dir, monkeypatch):
    expected = _generate(tiny_model_dir, ParallelConfig())
    shared = {"SLIPSTREAM_WORLD_SIZE": "2",
              "SLIPSTREAM_CONTROLLER_ADDR": f"127.0.0.1:{free_port()}",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    other_node = subprocess.Popen(
        [sys.executable, "-m", "slipstream.cli", "worker", "--log-level", "warning"],
        env={**os.environ, **shared, "SLIPSTREAM_NODE_RANKS": "1"})
    try:
        for name, value in {**shared, "SLIPSTREAM_NODE_RANKS": "0"}.items():
            monkeypatch.setenv(name, value)
        tokens = _generate(tiny_model_dir, ParallelConfig(tp=2))
        # The controller's STOP ends the other node's rank, and with it `slipstream worker`.
        assert other_node.wait(timeout=30) == 0
    finally:
        if other_node.poll() is None:
            other_node.kill()
            other_node.wait()
    assert tokens == expected
