"""LARS with a short lane (policies.LarsPolicy): the properties docs/scheduling.md promises.

- A request with little prefill work left is served at once, in deadline order, even while a
  late long prefill is being chunked (Medha's LARS, ``lars-classic``, holds it back until its
  relative slack falls below the long one's, i.e. to about its deadline).
- Once the oldest request of the long lane is late by more than the grace (``lars_reserve_grace``
  of its own TTFT deadlines) it keeps a share of every batch, so a stream of short requests
  cannot starve it: its wait is bounded by (1 + grace) deadlines plus its work at that share.
  Before that it waits its turn behind the short lane, which is what a burst needs.
- Lanes go by a request's prefill work; inside a lane the key is the deadline plus the
  prefill work left.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.offline_driver import Arrival, drive, make_request
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

TARGET_MS = 20.0
MS_PER_TOKEN = 0.05  # 400 tokens fill one 20 ms iteration
MODEL = AnalyticModel(ms_per_token=MS_PER_TOKEN)


def make_scheduler(policy: str, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(policy=policy, target_batch_time_ms=TARGET_MS, **config),
                     BlockManager(20_000), predictor=MODEL)


def ttft(request) -> float:
    return request.first_token_s - request.arrival_s


def late_long_and_shorts(short_gap_s: float, until_s: float) -> list[Arrival]:
    # The long prompt needs 1 s of prefill and is late from the start (0.2 s deadline); short
    # prompts (5 ms each, the default 0.5 s deadline) keep arriving while it is chunked.
    arrivals = [Arrival("long", 0.0, 20_000, 1, ttft_s=0.2)]
    count = int((until_s - 0.05) / short_gap_s)
    arrivals += [Arrival(f"short{i}", 0.05 + short_gap_s * i, 100, 1) for i in range(count)]
    return arrivals


def test_a_short_request_is_not_held_to_its_deadline_while_a_late_long_prefill_is_chunked():
    arrivals = late_long_and_shorts(short_gap_s=0.05, until_s=0.9)
    shorts = [a.request_id for a in arrivals if a.request_id.startswith("short")]
    lars = drive(make_scheduler("lars"), arrivals).finished
    classic = drive(make_scheduler("lars-classic"), arrivals).finished
    # The successor serves every short request in the next iteration or the one after.
    assert max(ttft(lars[name]) for name in shorts) <= 2 * TARGET_MS / 1000 + 1e-9
    # Medha's LARS keeps those that arrive while the long prefill has far to go waiting until
    # their relative slack drops below the late long one's: just past their 0.5 s deadline.
    early = [name for name in shorts if classic[name].arrival_s <= 0.5]
    assert min(ttft(classic[name]) for name in early) >= 0.5
    # The long prefill still gets the rest of every batch: it is barely slower.
    assert lars["long"].first_token_s <= classic["long"].first_token_s + 0.1


def test_a_late_long_prefill_keeps_its_share_under_a_flood_of_short_requests():
    # Shorts arrive every 4 ms with 5 ms of work each: more than the whole machine.
    arrivals = late_long_and_shorts(short_gap_s=0.004, until_s=4.0)
    reserved = drive(make_scheduler("lars"), arrivals, until_s=4.0, check_kv=False).finished
    # At half of each batch the 1 s prefill takes about 2 s once it is late.
    assert "long" in reserved and ttft(reserved["long"]) <= 0.2 + 2.0 + 0.3
    starved = drive(make_scheduler("lars", lars_late_reserve_fraction=0.0), arrivals,
                    until_s=4.0, check_kv=False).finished
    assert "long" not in starved, "without the reserve the short lane starves the long prefill"


@settings(max_examples=15, deadline=None)
@given(gap_ms=st.floats(2.0, 20.0), prompt=st.integers(20, 300),
       fraction=st.sampled_from([0.25, 0.5, 0.75]), long_tokens=st.integers(11_000, 24_000),
       grace=st.sampled_from([0.0, 1.0, 2.0, 4.0]))
def test_the_worst_long_wait_is_bounded_by_the_reserve_whatever_the_short_load(
        gap_ms, prompt, fraction, long_tokens, grace):
    gap_s, deadline_s = gap_ms / 1000, 0.3  # the long prompt: 0.55-1.2 s of work, long lane
    arrivals = [Arrival("long", 0.0, long_tokens, 1, ttft_s=deadline_s)]
    arrivals += [Arrival(f"s{i}", 0.01 + gap_s * i, prompt, 1) for i in range(int(4.0 / gap_s))]
    scheduler = make_scheduler("lars", lars_late_reserve_fraction=fraction,
                               lars_reserve_grace=grace)
    work_s = scheduler.prefill_times.total_s(long_tokens)
    # The reserve starts at the latest (1 + grace) deadlines after arrival; then the share.
    bound_s = (1 + grace) * deadline_s + work_s / fraction * 1.25 + 2 * TARGET_MS / 1000
    done = drive(scheduler, arrivals, until_s=bound_s + 0.5, check_kv=False).finished
    assert "long" in done and ttft(done["long"]) <= bound_s


def test_the_grace_keeps_the_reserve_out_of_ordinary_queueing():
    # A long prefill (1 s of work) a little late from the start (0.8 s deadline) and a burst
    # of 20 short prompts of one iteration each (0.4 s of work in all).
    arrivals = [Arrival("long", 0.0, 20_000, 1, ttft_s=0.8)]
    arrivals += [Arrival(f"short{i}", 0.01, 400, 1) for i in range(20)]
    shorts = [a.request_id for a in arrivals[1:]]
    graced = drive(make_scheduler("lars"), arrivals).finished  # default grace: 2 deadlines
    eager = drive(make_scheduler("lars", lars_reserve_grace=0.0), arrivals).finished
    # Without the grace the late long prefill takes half of every batch at once, so the
    # burst drains at half speed; with it the burst is served first, in 0.4 s.
    assert max(ttft(graced[name]) for name in shorts) <= 0.4 + 2 * TARGET_MS / 1000
    assert max(ttft(eager[name]) for name in shorts) >= 0.7
    # And the long prefill gains nothing from splitting the batches: the work is the same.
    assert ttft(graced["long"]) <= ttft(eager["long"]) + 2 * TARGET_MS / 1000


def test_lanes_by_prefill_work_then_deadline_plus_work_left():
    scheduler = make_scheduler("lars")  # short lane: at most 500 ms of prefill work
    policy = scheduler.policy
    long = make_request(Arrival("long", 0.0, 20_000, 1, ttft_s=0.5))  # 1 s of work, due first
    big = make_request(Arrival("big", 0.0, 8_000, 1))  # 400 ms: due at 0.6 s (1.5 x work)
    small = make_request(Arrival("small", 0.3, 100, 1))  # 5 ms: due at 0.8 s
    for request in (long, big, small):
        scheduler.add(request)
    assert not policy.in_short_lane(long)
    assert policy.in_short_lane(big) and policy.in_short_lane(small)

    def order(now_s):
        return [r.request_id for r in sorted((long, big, small),
                                             key=lambda r: policy.urgency(r, now_s))]

    # Lanes first: the long request is due first and still goes last. In the short lane the
    # key is deadline + work left: 0.8 + 0.005 for the small one beats 0.6 + 0.4.
    assert order(0.3) == ["small", "big", "long"]
    # A started prefill keeps its place: with 100 ms left, big's key is 0.7.
    big.num_computed_tokens = 6_000
    assert order(0.3) == ["big", "small", "long"]
    # A short-lane request stays there whatever happens to its work left.
    long.num_computed_tokens = 19_000
    assert not policy.in_short_lane(long) and order(0.3)[-1] == "long"
    # A share is kept only for a request late by more than the grace (two of its own 0.5 s
    # deadlines): 1 s of work due at 0.5 s is 0.5 s late at 0, and more than 1 s late after 0.5.
    long.num_computed_tokens = 0
    anyone = lambda request: True  # noqa: E731
    fraction = SchedulerConfig().lars_late_reserve_fraction
    assert SchedulerConfig().lars_reserve_grace == 2.0
    assert policy.reserved_request(0.0, anyone) is None
    assert policy.reserved_request(0.49, anyone) is None
    assert policy.reserved_request(0.51, anyone) == (long, fraction)
    assert policy.reserved_request(0.51, lambda request: False) is None  # cannot run now


def test_the_reserve_goes_to_the_oldest_late_long_request_not_the_earliest_deadline():
    scheduler = make_scheduler("lars")
    policy = scheduler.policy
    old = make_request(Arrival("old", 0.0, 40_000, 1, ttft_s=3.0))  # 2 s of work
    new = make_request(Arrival("new", 1.0, 20_000, 1, ttft_s=1.5))  # 1 s, due earlier
    scheduler.add(old)
    scheduler.add(new)
    assert policy.urgency(new, 1.0) < policy.urgency(old, 1.0)  # deadline order
    # old: 2 s of work due at 3 s is more than two deadlines (6 s) late once now > 7 s.
    assert policy.reserved_request(7.1, lambda request: True) == (
        old, SchedulerConfig().lars_late_reserve_fraction)
