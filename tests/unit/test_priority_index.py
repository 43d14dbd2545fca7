"""The incremental prefill order equals a brute-force sort of the policy's urgency."""

import random

import pytest

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.offline_driver import Arrival, make_request
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.agent.scheduler.priority_index import PriorityIndex
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig


@pytest.mark.parametrize("policy", ["fcfs", "edf", "lrs", "lars", "lars-classic", "srpt", "justitia"])
def test_candidate_order_is_the_sorted_urgency_at_any_time(policy):
    rng = random.Random(7)
    scheduler = Scheduler(SchedulerConfig(policy=policy), BlockManager(100_000),
                          predictor=AnalyticModel(ms_per_token=0.05, ms_per_attended_pair=1e-7))
    for i in range(400):
        scheduler.add(make_request(Arrival(
            f"r{i}", rng.uniform(0, 5), rng.choice([10, 300, 2000, 9000, 40_000]),
            rng.randint(1, 50), ttft_s=rng.choice([None, 0.3, 2.0, 30.0]), app_id=f"a{i % 5}")))
    for now_s in (0.0, 3.0, 20.0, 400.0):
        order = list(scheduler.queue.candidates(now_s, include_waiting=True))
        urgency = [scheduler.policy.urgency(request, now_s) for request in order]
        assert len(order) == 400
        assert urgency == sorted(urgency)


def test_lars_classic_class_order_tracks_exact_relative_slack():
    scheduler = Scheduler(SchedulerConfig(policy="lars-classic"), BlockManager(100_000),
                          predictor=AnalyticModel(ms_per_token=0.05))
    for i, (prompt, ttft_s) in enumerate([(100, 0.5), (20_000, 3.0), (2_000, 0.4), (60_000, 9.0)]):
        scheduler.add(make_request(Arrival(f"r{i}", 0.0, prompt, 1, ttft_s=ttft_s)))
    for now_s in (0.0, 0.2, 1.0, 5.0):
        order = list(scheduler.queue.candidates(now_s, include_waiting=True))
        exact = [scheduler.urgency.relative_slack(request, now_s) for request in order]
        assert exact == sorted(exact)


def test_index_removal_and_ties_keep_arrival_order():
    index = PriorityIndex()
    requests = [make_request(Arrival(f"r{i}", 0.0, 4, 1)) for i in range(6)]
    for request in requests:
        index.add(request, key=1.0)
    index.remove(requests[2])
    assert [r.request_id for _, _, r in index.ordered(0.0)] == ["r0", "r1", "r3", "r4", "r5"]
    assert requests[2] not in index and len(index) == 5
    with pytest.raises(ValueError):
        index.add(requests[0], key=0.0)
