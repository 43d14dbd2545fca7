"""Adaptive Wait-Depth batching (PLA-Serve Algorithm 1) on a hand-driven clock: early
dispatch near a deadline, release at the target depth, length buckets, and how the window and
the depth adapt."""

from __future__ import annotations

import pytest

from slipstream.agent.scheduler.awd import AdaptiveWaitDepth, AWDConfig, PendingPrefill

MS = 0.001


def config(**overrides) -> AWDConfig:
    settings = dict(graph_lengths_tokens=(8, 16, 32, 64, 128), graph_depths=(1, 2, 4, 8),
                    token_budget=512, min_wait_s=0.0, max_wait_s=100 * MS,
                    max_head_wait_s=200 * MS, slack_threshold_s=10 * MS,
                    initial_service_s=10 * MS)
    settings.update(overrides)
    return AWDConfig(**settings)


def prefill(name: str, tokens: int, at_s: float, deadline_s: float | None = None):
    return PendingPrefill(request_id=name, prompt_tokens=tokens, arrival_s=at_s,
                          deadline_s=deadline_s)


def test_a_request_near_its_deadline_is_dispatched_early():
    awd = AdaptiveWaitDepth(config())
    awd.add(prefill("urgent", 20, at_s=0.0, deadline_s=25 * MS))
    # Slack = deadline - (now + S) = 25 - now - 10 ms; it reaches the 10 ms threshold at 5 ms,
    # long before the 100 ms window.
    assert awd.next_poll_s(0.0) == pytest.approx(5 * MS)
    assert awd.poll(1 * MS) is None
    batch = awd.poll(5 * MS)
    assert batch is not None and batch.reason == "deadline"
    assert batch.request_ids == ("urgent",)
    assert awd.num_waiting() == 0


def test_without_a_deadline_the_same_request_waits_for_the_window():
    awd = AdaptiveWaitDepth(config())
    awd.add(prefill("relaxed", 20, at_s=0.0))
    assert awd.poll(5 * MS) is None
    assert awd.next_poll_s(5 * MS) == pytest.approx(100 * MS)
    batch = awd.poll(100 * MS)
    assert batch.reason == "window" and batch.request_ids == ("relaxed",)


def test_an_urgent_arrival_releases_the_requests_batched_with_it():
    awd = AdaptiveWaitDepth(config())
    awd.add(prefill("a", 30, at_s=0.0))
    awd.add(prefill("b", 28, at_s=40 * MS))
    # Arrivals 40 ms apart: the depth of 4 is two gaps (80 ms) away; keep waiting.
    assert awd.poll(41 * MS) is None
    awd.add(prefill("c", 31, at_s=42 * MS, deadline_s=61 * MS))
    batch = awd.poll(42 * MS)  # c's slack: 61 - 42 - 10 = 9 ms <= 10 ms
    assert batch.reason == "deadline" and set(batch.request_ids) == {"a", "b", "c"}
    assert awd.num_waiting() == 0


def test_the_batch_is_released_when_it_reaches_the_target_depth():
    awd = AdaptiveWaitDepth(config())
    assert awd.target_depth == 4  # deepest captured depth with 4 * 128 <= 512 tokens
    for index in range(4):
        awd.add(prefill(f"r{index}", 100, at_s=index * MS))
    batch = awd.poll(3 * MS)
    assert batch.reason == "depth" and batch.depth == 4
    assert batch.graph_shape == (128, 4) and batch.padded_length_tokens == 128


def test_requests_are_grouped_by_length_bucket():
    awd = AdaptiveWaitDepth(config(max_wait_s=5 * MS))
    awd.add(prefill("tiny", 5, at_s=0.0))
    awd.add(prefill("mid", 30, at_s=0.0))
    awd.add(prefill("big", 100, at_s=0.0, deadline_s=1.0))
    first = awd.poll(5 * MS)
    # The most urgent request's bucket (128) leads; smaller requests pad up into it.
    assert first.padded_length_tokens == 128
    assert set(first.request_ids) == {"tiny", "mid", "big"}
    awd.add(prefill("small", 7, at_s=10 * MS, deadline_s=1.0))
    awd.add(prefill("large", 120, at_s=10 * MS))
    second = awd.poll(20 * MS)
    # A short request's batch never takes longer ones (they would pad it up).
    assert second.request_ids == ("small",) and second.padded_length_tokens == 8


def test_the_window_and_the_depth_adapt_to_how_batches_fill():
    awd = AdaptiveWaitDepth(config(max_head_wait_s=1.0))
    # A quiet spell: only two requests arrive before the window closes; D drops to 2.
    awd.add(prefill("a", 20, at_s=0.0))
    awd.add(prefill("b", 20, at_s=40 * MS))
    batch = awd.poll(100 * MS)
    assert batch.reason == "window" and awd.target_depth == 2
    # Then a burst fills D in 3 ms: W shrinks to that fill time and D grows to the next shape.
    awd.add(prefill("c", 20, at_s=200 * MS))
    awd.add(prefill("d", 20, at_s=203 * MS))
    batch = awd.poll(203 * MS)
    assert batch.reason == "depth" and batch.fill_time_s == pytest.approx(3 * MS)
    assert awd.window_fill_s == pytest.approx(3 * MS)
    assert awd.target_depth == 4


def test_a_steady_arrival_rate_fills_the_target_depth_instead_of_halving_it():
    awd = AdaptiveWaitDepth(config(max_wait_s=100 * MS))
    assert awd.target_depth == 4
    released = []
    for index in range(4):  # one request per ms, polled every ms as an engine loop would
        awd.add(prefill(f"r{index}", 20, at_s=index * MS))
        released.append(awd.poll(index * MS))
        if index < 3:
            assert awd.poll((index + 0.9) * MS) is None  # the next arrival is due, not late
    assert released[:3] == [None, None, None]
    assert released[3].reason == "depth" and released[3].depth == 4
    assert awd.target_depth == 8


def test_the_rate_window_counts_from_the_latest_arrival():
    awd = AdaptiveWaitDepth(config())
    awd.add(prefill("a", 20, at_s=0.0))
    awd.add(prefill("b", 20, at_s=10 * MS))
    # Gap 10 ms, two more to reach D = 4: expected at 10 + 2 * 10 = 30 ms.
    assert awd.next_poll_s(10 * MS) == pytest.approx(30 * MS)
    assert awd.poll(29 * MS) is None
    assert awd.poll(30 * MS).reason == "window"


def test_removing_a_waiting_request():
    awd = AdaptiveWaitDepth(config())
    awd.add(prefill("a", 20, at_s=0.0))
    awd.add(prefill("b", 20, at_s=1 * MS))
    assert awd.remove("a") and not awd.remove("a")
    assert awd.num_waiting() == 1
    assert awd.poll(1.0).request_ids == ("b",)
    awd.add(prefill("c", 20, at_s=2.0))
    assert awd.remove("c") and awd.next_poll_s(2.0) is None
    awd.add(prefill("d", 20, at_s=3.0))  # a fresh round starts at d's own arrival
    assert awd.poll(3.0 + 1 * MS) is None


def test_prompts_longer_than_the_longest_bucket_are_refused():
    awd = AdaptiveWaitDepth(config())
    with pytest.raises(ValueError, match="not a short prefill"):
        awd.add(prefill("long", 129, at_s=0.0))
