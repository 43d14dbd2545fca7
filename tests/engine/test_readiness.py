"""Ready means serving: the engine's warm-up runs a real request and leaves no trace, and the
KV cache of a CPU engine takes a bounded share of the host's memory."""

from __future__ import annotations

import pytest

from slipstream.agent.engine import config as engine_config
from slipstream.agent.engine.config import EngineConfig, kv_cache_budget_gib
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


def test_the_cpu_kv_budget_is_a_share_of_available_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 8 * 2**30)
    single = EngineConfig(model_dir=tmp_path)
    eight_ranks = EngineConfig(model_dir=tmp_path, parallel=ParallelConfig(tp=2, spp=2, kvp=2))
    assert kv_cache_budget_gib(single, "cpu") == pytest.approx(8 / 32)
    assert kv_cache_budget_gib(eight_ranks, "cpu") == pytest.approx(8 / 32 / 8)
    assert kv_cache_budget_gib(single, "cuda") == 1.0
    assert kv_cache_budget_gib(EngineConfig(model_dir=tmp_path, kv_cache_memory_gib=3.0),
                               "cpu") == 3.0
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 1 << 20)
    assert kv_cache_budget_gib(eight_ranks, "cpu") == engine_config.CPU_KV_CACHE_MIN_GIB
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 1 << 50)
    assert kv_cache_budget_gib(single, "cpu") == engine_config.CPU_KV_CACHE_MAX_GIB


def test_available_memory_is_read():
    assert engine_config.available_memory_bytes() > 0
