"""Adaptive Wait-Depth short-prefill batching in the live engine (tiny model on CPU).

On a hand-set clock (``LLMEngine(clock=...)``) the batches are exact: a burst of short prompts
runs as one prefill batch, greedy outputs equal AWD off, and a near deadline releases early.
On the real clock the engine thread must sleep while requests are held (no busy loop), and
an aborted held request must leave nothing behind.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine.async_engine import AsyncEngine
from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.step.stats import StepStats
from slipstream.contracts.request import RequestSLO
from slipstream.agent.scheduler.scheduler import SchedulerConfig

MS = 0.001
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# 33..61 tokens: one AWD length bucket (64), so the whole burst may form one group.
PROMPTS = [[3 + (i * 7 + j) % 200 for j in range(33 + 7 * i)] for i in range(5)]


class HandClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def awd_config(**overrides) -> SchedulerConfig:
    # Buckets 8..64 under a 512-token iteration: AWD's first target depth is 8.
    settings = dict(max_batched_tokens=512, short_prefill_batching="awd",
                    awd_max_prompt_tokens=64, awd_max_wait_ms=50.0, awd_max_head_wait_ms=100.0)
    settings.update(overrides)
    return SchedulerConfig(**settings)


def make_engine(tiny_model_dir, scheduler_config: SchedulerConfig, clock=time.monotonic):
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=128),
                     scheduler_config, clock=clock)


class ScheduleCounter:
    """Counts ``schedule`` calls of a live engine (it delegates to the real scheduler)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls = 0
        self._schedule = engine.scheduler.schedule
        self._lock = threading.Lock()
        engine.scheduler.schedule = self

    def __call__(self, now_s: float):
        with self._lock:
            self.calls += 1
        return self._schedule(now_s)


def run_to_completion(engine: LLMEngine, clock: HandClock, ids: list[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    for _ in range(500):
        if not engine.has_unfinished():
            return tokens
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        clock.now_s += max(engine.idle_wait_s(), 1 * MS)
    raise AssertionError("requests did not finish")


def test_a_burst_of_short_prompts_runs_as_one_batch_with_the_same_greedy_tokens(tiny_model_dir):
    clock = HandClock()
    engine = make_engine(tiny_model_dir, awd_config(), clock)
    batches: list[StepStats] = []
    engine.on_step = batches.append
    ids = []
    for index, prompt in enumerate(PROMPTS):  # one arrival per ms
        clock.now_s = index * MS
        ids.append(engine.add_request(prompt, GREEDY))
        assert engine.step() == [] and engine.last_step_ran_nothing
        assert engine.has_unfinished() and engine.stats().num_waiting == index + 1
    # Gap 1 ms, 3 more to reach the depth of 8: the window closes at 4 + 3 = 7 ms.
    assert engine.idle_wait_s() == pytest.approx(3 * MS)
    clock.now_s = 6.9 * MS
    assert engine.step() == []
    clock.now_s = 7 * MS
    tokens = run_to_completion(engine, clock, ids)

    first = batches[0].batch
    assert len(first.chunks) == len(PROMPTS) and first.num_decodes == 0
    assert sorted(len(chunk.token_ids) for chunk in first.chunks) == [len(p) for p in PROMPTS]
    assert all(len(tokens[request_id]) == GREEDY.max_tokens for request_id in ids)
    reference = make_engine(tiny_model_dir, SchedulerConfig(max_batched_tokens=512))
    assert [tokens[request_id] for request_id in ids] == reference.generate(PROMPTS, GREEDY)


def test_a_request_near_its_deadline_is_dispatched_before_the_window(tiny_model_dir):
    clock = HandClock()
    engine = make_engine(tiny_model_dir, awd_config(awd_max_wait_ms=500.0,
                                                    awd_max_head_wait_ms=1000.0), clock)
    engine.add_request(PROMPTS[0], GREEDY, slo=RequestSLO(ttft_s=0.1))
    assert engine.step() == []
    # Deadline 100 ms, service estimate 10 ms, slack threshold 10 ms: due at 80 ms, not 500.
    assert engine.idle_wait_s() == pytest.approx(80 * MS)
    clock.now_s = 79 * MS
    assert engine.step() == []
    clock.now_s = 80 * MS
    outputs = engine.step()
    assert [len(output.new_token_ids) for output in outputs] == [1]


def test_offline_generate_sleeps_through_the_window_instead_of_spinning(tiny_model_dir):
    engine = make_engine(tiny_model_dir, awd_config(awd_max_wait_ms=30.0))
    counter = ScheduleCounter(engine)
    started = time.monotonic()
    tokens = engine.generate(PROMPTS[:1], GREEDY)
    assert time.monotonic() - started >= 0.03  # a lone request waits out the window
    # One empty step, the prefill, five decodes (and perhaps one early wake-up).
    assert counter.calls <= GREEDY.max_tokens + 3
    reference = make_engine(tiny_model_dir, SchedulerConfig(max_batched_tokens=512))
    assert tokens == reference.generate(PROMPTS[:1], GREEDY)


async def _first_output_after(engine: AsyncEngine, request_id: str, prompt: list[int]):
    submitted = time.monotonic()
    stream = engine.generate(EngineRequest(request_id, prompt, GREEDY))
    first = await stream.__anext__()
    first_token_delay_s = time.monotonic() - submitted
    outputs = [first] + [output async for output in stream]
    return first_token_delay_s, outputs


def test_the_engine_thread_sleeps_while_a_request_is_held(tiny_model_dir):
    engine = make_engine(tiny_model_dir, awd_config(awd_max_wait_ms=300.0,
                                                    awd_max_head_wait_ms=400.0))
    counter = ScheduleCounter(engine)
    async_engine = AsyncEngine(engine.config, engine=engine)

    async def scenario():
        await async_engine.start()
        try:
            task = asyncio.create_task(_first_output_after(async_engine, "held", PROMPTS[1]))
            await asyncio.sleep(0.2)
            calls_while_held = counter.calls
            delay_s, outputs = await task
            return calls_while_held, delay_s, outputs
        finally:
            await async_engine.shutdown()

    calls_while_held, delay_s, outputs = asyncio.run(scenario())
    # One schedule() after the request came in, then a sleep until AWD's 300 ms window.
    assert calls_while_held <= 3
    assert delay_s >= 0.29
    assert outputs[-1].finished and outputs[-1].num_output_tokens == GREEDY.max_tokens


def test_aborting_a_held_request_frees_it(tiny_model_dir):
    engine = make_engine(tiny_model_dir, awd_config(awd_max_wait_ms=2000.0,
                                                    awd_max_head_wait_ms=3000.0))
    batches: list[StepStats] = []
    engine.on_step = batches.append
    async_engine = AsyncEngine(engine.config, engine=engine)

    async def scenario():
        await async_engine.start()
        try:
            stream = async_engine.generate(EngineRequest("doomed", PROMPTS[2], GREEDY))
            pending = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.1)
            assert async_engine.stats().num_waiting == 1  # held, not running
            await async_engine.abort("doomed")
            return await asyncio.wait_for(pending, timeout=5)
        finally:
            await async_engine.shutdown()

    output = asyncio.run(scenario())
    assert output.finished and output.finish_reason == "abort"
    assert not engine.has_unfinished() and engine.stats().num_waiting == 0
    assert engine.scheduler.next_wakeup_s(time.monotonic()) is None
    assert engine.block_manager.kv_blocks_used == 0
    assert batches == []  # the dead request was never dispatched
