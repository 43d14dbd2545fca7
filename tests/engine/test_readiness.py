"""Ready means serving: the engine's warm-up runs a real request and leaves no trace, and the
KV cache of a CPU engine takes a bounded share of the host's memory."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.parallel_config import ParallelConfig


def test_warm_up_runs_one_request_and_leaves_no_trace(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=64))
    observed = []
    engine.on_step = observed.append
    calls = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: calls.append(batch) or execute(batch)
    engine.warm_up()
    assert calls, "the warm-up ran no step"
    assert observed == []  # step observers (metrics) never saw it
    assert engine.on_step is not None
    assert not engine.has_unfinished()
    assert engine.block_manager.kv_blocks_used == 0
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.utilization == 0.0


def test_warm_up_fails_loudly_when_the_step_fails(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=64))

    def broken(batch):
        raise RuntimeError("device lost")

    engine.runner.execute = broken
    with pytest.raises(RuntimeError, match="warm-up"):
        engine.warm_up()


def test_the_cpu_kv_budget_is_a_share_of_available_memory(tiny_model_dir, monkeypatch):
    import torch

    from slipstream.agent.engine.step import model_runner
    from slipstream.agent.engine.config import ModelConfig
    from slipstream.agent.engine.kv.memory import DEFAULT_CPU_FRACTION

    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda device: 8 * 2**30)
    model = ModelConfig.from_dir(tiny_model_dir)
    single = EngineConfig(model_dir=tiny_model_dir)
    eight_ranks = EngineConfig(model_dir=tiny_model_dir,
                               parallel=ParallelConfig(tp=2, spp=2, kvp=2))
    heads = model.num_layers * model.num_kv_heads
    cpu = torch.device("cpu")
    block_bytes = 2 * heads * model.head_dim * 16 * 4
    plan = model_runner.plan_kv_blocks(single, model, cpu, torch.float32, heads)
    assert plan.num_blocks == int(DEFAULT_CPU_FRACTION * 8 * 2**30) // block_bytes
    # Ranks of one machine split the host's memory between them.
    split = model_runner.plan_kv_blocks(eight_ranks, model, cpu, torch.float32, heads,
                                        ranks_sharing_memory=8)
    assert split.num_blocks == int(DEFAULT_CPU_FRACTION * 2**30) // block_bytes


def test_available_memory_is_read():
    import torch

    from slipstream.agent.engine.kv.memory import available_memory_bytes

    assert available_memory_bytes(torch.device("cpu")) > 0
