"""A KV cache too small for the offered load: requests are preempted and resumed, every one
finishes, and greedy outputs are exactly those of a run with ample memory."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.scheduler import SchedulerConfig


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_finish_with_identical_greedy_output(tiny_model_dir, mode):
    prompts = [[(17 * i + 3 * j) % 4000 for j in range(40 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results, preemptions = [], []
    for num_blocks in (10, 256):  # 10 blocks = 160 tokens; one request needs up to 6 blocks
        engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu",
                                        num_kv_blocks=num_blocks),
                           SchedulerConfig(max_batched_tokens=64, preemption=mode))
        swap_copies = []
        execute = engine.runner.execute

        def counting_execute(batch):
            swap_copies.extend(batch.swap_out + batch.swap_in)
            return execute(batch)

        engine.runner.execute = counting_execute
        results.append(engine.generate(prompts, params))
        if mode == "swap" and num_blocks == 10:
            assert swap_copies, "swap mode should move blocks to host memory and back"
        preemptions.append(engine.stats().num_preemptions_total)
        assert engine.block_manager.kv_blocks_used == 0
    small, ample = results
    assert preemptions[0] > 0, "the small cache should have forced preemptions"
    assert preemptions[1] == 0
    assert all(len(tokens) == 40 for tokens in small)
    assert small == ample
