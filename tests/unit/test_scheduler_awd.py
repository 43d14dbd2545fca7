"""Adaptive Wait-Depth inside the Scheduler (``short_prefill_batching="awd"``), on a hand-driven
clock: short prompts are held and released as a group, a near deadline releases early, long
prompts bypass, aborted held requests leave no trace, and the wakeup time is exact."""

from __future__ import annotations

import pytest

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.offline_driver import Arrival, drive, make_request
from slipstream.agent.scheduler.request import FinishReason
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

MS = 0.001


def make_scheduler(**overrides) -> Scheduler:
    # Buckets 8..64 under a 512-token budget: AWD's first target depth is 512 / 64 = 8.
    settings = dict(short_prefill_batching="awd", max_batched_tokens=512,
                    awd_max_prompt_tokens=64, awd_max_wait_ms=20.0, awd_max_head_wait_ms=50.0,
                    awd_slack_threshold_ms=10.0)
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings), BlockManager(1024))


def add(scheduler: Scheduler, name: str, prompt_tokens: int, at_s: float,
        ttft_s: float | None = None) -> None:
    scheduler.add(make_request(Arrival(name, at_s, prompt_tokens, 4, ttft_s=ttft_s)))


def prefill_ids(scheduler: Scheduler, now_s: float) -> list[str]:
    return [chunk.request_id for chunk in scheduler.schedule(now_s).chunks]


def test_short_prompts_are_held_until_the_window_then_released_together():
    scheduler = make_scheduler()
    for i in range(4):
        add(scheduler, f"s{i}", 10 + i, at_s=0.0)
    assert scheduler.num_waiting == 4 and scheduler.has_unfinished()
    assert prefill_ids(scheduler, 5 * MS) == []  # held: depth 4 < 8, window 20 ms not over
    assert scheduler.next_wakeup_s(5 * MS) == pytest.approx(20 * MS)
    assert sorted(prefill_ids(scheduler, 20 * MS)) == ["s0", "s1", "s2", "s3"]
    assert scheduler.num_running == 4 and scheduler.next_wakeup_s(20 * MS) is None


def test_the_window_closes_when_the_arrival_rate_says_the_batch_should_be_full():
    scheduler = make_scheduler()
    for i in range(4):
        add(scheduler, f"s{i}", 10, at_s=i * MS)
    # One arrival per ms and 4 more to reach the depth of 8: expected full at 3 + 4 = 7 ms.
    assert scheduler.next_wakeup_s(3 * MS) == pytest.approx(7 * MS)
    assert prefill_ids(scheduler, 6 * MS) == []
    assert len(prefill_ids(scheduler, 7 * MS)) == 4


def test_reaching_the_target_depth_releases_at_once():
    scheduler = make_scheduler()
    for i in range(8):
        add(scheduler, f"s{i}", 12, at_s=0.0)
    assert len(prefill_ids(scheduler, 0.0)) == 8


def test_a_request_near_its_deadline_is_dispatched_before_the_window_ends():
    scheduler = make_scheduler(awd_max_wait_ms=200.0, awd_max_head_wait_ms=300.0)
    add(scheduler, "relaxed", 10, at_s=0.0)
    add(scheduler, "urgent", 10, at_s=0.0, ttft_s=40 * MS)
    # Slack = deadline - (now + S) with S = 10 ms reaches sigma = 10 ms at 40 - 10 - 10 = 20 ms.
    assert scheduler.next_wakeup_s(0.0) == pytest.approx(20 * MS)
    assert prefill_ids(scheduler, 19 * MS) == []
    # The urgent request takes the request batched with it along.
    assert sorted(prefill_ids(scheduler, 20 * MS)) == ["relaxed", "urgent"]


def test_long_prompts_bypass_the_hold():
    scheduler = make_scheduler()
    add(scheduler, "short", 10, at_s=0.0)
    add(scheduler, "long", 65, at_s=0.0)  # longer than the longest bucket (64)
    assert prefill_ids(scheduler, 0.0) == ["long"]
    assert scheduler.num_waiting == 1


def test_prompts_at_the_long_request_threshold_bypass_even_inside_the_buckets():
    scheduler = make_scheduler(long_request_threshold_tokens=32)
    add(scheduler, "under", 31, at_s=0.0)
    add(scheduler, "at", 32, at_s=0.0)
    assert prefill_ids(scheduler, 0.0) == ["at"]


def test_an_aborted_held_request_is_freed_and_never_dispatched():
    scheduler = make_scheduler()
    add(scheduler, "gone", 10, at_s=0.0)
    add(scheduler, "kept", 10, at_s=0.0)
    aborted = scheduler.finish("gone", FinishReason.ABORT, 1 * MS)
    assert aborted is not None and aborted.is_finished
    assert scheduler.num_waiting == 1
    assert prefill_ids(scheduler, 1.0) == ["kept"]
    scheduler.finish("kept", FinishReason.ABORT, 1.0)
    assert not scheduler.has_unfinished() and scheduler.num_waiting == 0
    assert scheduler.next_wakeup_s(1.0) is None
    assert scheduler.block_manager.kv_blocks_used == 0


def test_the_last_held_request_aborted_clears_the_wakeup():
    scheduler = make_scheduler()
    add(scheduler, "only", 10, at_s=0.0)
    assert scheduler.next_wakeup_s(0.0) is not None
    scheduler.finish("only", FinishReason.ABORT, 0.0)
    assert scheduler.next_wakeup_s(0.0) is None and not scheduler.has_unfinished()
    assert scheduler.schedule(1.0).is_empty
    # A later arrival opens a fresh round from its own arrival, not from the aborted one's.
    add(scheduler, "next", 10, at_s=2.0)
    assert scheduler.next_wakeup_s(2.0) == pytest.approx(2.0 + 20 * MS)


def test_the_released_step_time_becomes_the_service_estimate():
    scheduler = make_scheduler()
    hold = scheduler.short_prefills
    for i in range(8):
        add(scheduler, f"s{i}", 12, at_s=0.0)
    batch = scheduler.schedule(0.0)
    before = hold.awd.service_estimate_s
    scheduler.update(batch, {c.request_id: 1 for c in batch.chunks if c.sample}, 50 * MS)
    assert hold.awd.service_estimate_s > before  # moved towards the measured 50 ms


def test_off_admits_every_request_at_once():
    scheduler = make_scheduler(short_prefill_batching="off")
    add(scheduler, "s", 10, at_s=0.0)
    assert prefill_ids(scheduler, 0.0) == ["s"]
    assert scheduler.next_wakeup_s(0.0) is None


def test_a_driven_stream_with_awd_finishes_every_request_with_the_same_tokens():
    arrivals = [Arrival(f"r{i}", i * 3 * MS, 5 + (i * 7) % 60, 3 + i % 4) for i in range(40)]
    arrivals.append(Arrival("long", 10 * MS, 900, 5))
    with_awd = drive(make_scheduler(), arrivals)
    without = drive(make_scheduler(short_prefill_batching="off"), arrivals)
    assert set(with_awd.finished) == {a.request_id for a in arrivals}
    for request_id, request in with_awd.finished.items():
        assert request.output_token_ids == without.finished[request_id].output_token_ids
    # The empty steps jump to AWD's wakeups instead of ticking: few steps beyond the work.
    assert with_awd.num_steps < without.num_steps + 40


@pytest.mark.parametrize(("field", "value"), [
    ("short_prefill_batching", "sometimes"),
    ("awd_max_prompt_tokens", 100),
    ("awd_max_prompt_tokens", 4),
    ("awd_max_wait_ms", -1.0),
    ("awd_max_head_wait_ms", -1.0),
])
def test_invalid_awd_settings_are_rejected(field, value):
    with pytest.raises(ValueError):
        SchedulerConfig(**{field: value})
