"""Medha section 4.1's three-request example, driven through the real scheduler.

r_L needs 10 s of prefill with a 16 s TTFT deadline and arrives at 0; r_S1 and r_S2 need
0.5 s each with a 1 s deadline and arrive at 5. Times are exact binary fractions (62.5 ms
iterations of 512 tokens) so that iteration boundaries fall on the arrival time.
"""

import pytest

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.offline_driver import Arrival, drive
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

TARGET_MS = 62.5
MS_PER_TOKEN = TARGET_MS / 512  # 512 tokens fill one iteration exactly
TOKENS_PER_S = round(1000 / MS_PER_TOKEN)


def run(policy: str) -> dict:
    scheduler = Scheduler(SchedulerConfig(policy=policy, target_batch_time_ms=TARGET_MS),
                          BlockManager(20_000), predictor=AnalyticModel(MS_PER_TOKEN))
    arrivals = [
        Arrival("long", 0.0, 10 * TOKENS_PER_S, 1, ttft_s=16.0),
        Arrival("short1", 5.0, TOKENS_PER_S // 2, 1, ttft_s=1.0),
        Arrival("short2", 5.0, TOKENS_PER_S // 2, 1, ttft_s=1.0),
    ]
    return drive(scheduler, arrivals).finished


def met_deadline(request) -> bool:
    return request.first_token_s <= request.ttft_deadline_s + 1e-9


def test_fcfs_convoy_short_requests_wait_for_the_long_one():
    done = run("fcfs")
    assert done["long"].first_token_s == pytest.approx(10.0)
    for name in ("short1", "short2"):
        assert done[name].first_scheduled_s >= 10.0 - TARGET_MS / 1000
        assert not met_deadline(done[name])


def test_edf_short_requests_preempt_at_arrival_and_everyone_meets_deadlines():
    done = run("edf")
    for name in ("short1", "short2"):
        assert done[name].first_scheduled_s < 5.0 + 2 * TARGET_MS / 1000
        assert met_deadline(done[name])
    assert done["long"].first_token_s == pytest.approx(11.0)  # delayed by the shorts' 1 s
    assert met_deadline(done["long"])


def test_lars_classic_short_requests_wait_until_their_relative_slack_drops_below_the_long_one():
    done = run("lars-classic")
    # At t=5: rho_long = (16 - 5 - 5) / 10 = 0.6, rho_short = (6 - 5 - 0.5) / 0.5 = 1.0. The
    # shorts' rho falls at 2 per second, so they overtake at t = 5.2, not before.
    for name in ("short1", "short2"):
        assert 5.15 <= done[name].first_scheduled_s <= 5.2 + 2 * TARGET_MS / 1000
    assert met_deadline(done["long"])
    fcfs = run("fcfs")
    for name in ("short1", "short2"):
        assert done[name].first_token_s < fcfs[name].first_token_s - 3.0


def test_lars_serves_the_short_requests_at_arrival_and_everyone_meets_deadlines():
    # The successor orders the example as Medha wants it: both shorts (short lane, 0.5 s of
    # work each) go ahead of the long request as soon as they arrive, and every request meets
    # its deadline. With the key deadline + work left, the short that starts first keeps
    # going (its key falls as it is served), so one finishes at 5.5 s and the other at 6 s,
    # where sharing the batch would finish both near 6 s.
    done = run("lars")
    first, second = sorted((done["short1"], done["short2"]), key=lambda r: r.first_token_s)
    assert first.first_scheduled_s == pytest.approx(5.0)
    assert first.first_token_s == pytest.approx(5.5)
    assert second.first_token_s == pytest.approx(6.0)
    for name in ("short1", "short2", "long"):
        assert met_deadline(done[name])
    assert done["long"].first_token_s == pytest.approx(11.0)  # delayed by the shorts' 1 s
