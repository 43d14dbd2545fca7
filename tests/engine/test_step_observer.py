"""``LLMEngine.on_step``: called once per executed batch with that batch and ordered clock
readings, and the agent's StepMetrics observer counts exactly the tokens the engine ran."""

from __future__ import annotations

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.step.stats import StepStats
from slipstream.agent.scheduler.scheduler import SchedulerConfig
from slipstream.agent.server.step_metrics import StepMetrics


def test_on_step_sees_every_batch_and_step_metrics_count_its_tokens(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=64),
                       SchedulerConfig(max_batched_tokens=32))
    steps: list[StepStats] = []
    metrics = StepMetrics()

    def observe(step: StepStats) -> None:
        steps.append(step)
        metrics.observe(step)

    engine.on_step = observe
    prompts = [[5 + i for i in range(70)], [9, 8, 7]]  # 70 tokens: chunked at 32 per step
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)

    assert [len(tokens) for tokens in outputs] == [5, 5]
    assert all(s.schedule_start_s <= s.execute_start_s <= s.execute_end_s for s in steps)
    assert all(s.batch.chunks for s in steps)
    executed_tokens = sum(s.batch.num_tokens for s in steps)
    # Prompt tokens once each (no preemption here), plus one decode per token after the first.
    assert executed_tokens == 73 + 2 * 4
    assert metrics.prefill_tokens_total == 73
    assert metrics.decode_tokens_total == 8
    # Every batch keeps to the 32-token budget, so the 70-token prompt is prefilled in at
    # least three chunks (how they interleave with the short prompt is the policy's choice).
    assert all(s.batch.num_tokens <= 32 for s in steps)
    by_request: dict[str, list] = {}
    for s in steps:
        for c in s.batch.chunks:
            by_request.setdefault(c.request_id, []).append(c)
    long_prefill = [c for chunks in by_request.values()
                    if sum(len(c.token_ids) for c in chunks) == 70 + 4
                    for c in chunks if c.start_pos < 70]
    assert len(long_prefill) >= 3
    assert sum(len(c.token_ids) for c in long_prefill) == 70
    assert metrics.batch_time_actual_s.counts and sum(metrics.batch_time_actual_s.counts) == \
        len(steps)
    engine.on_step = None
    engine.generate([[1, 2, 3]], params)
    assert sum(metrics.batch_time_actual_s.counts) == len(steps)  # no observer, no calls
