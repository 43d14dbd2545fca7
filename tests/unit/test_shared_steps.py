"""Short steps while applications share an instance (scheduler/shared_steps.py).

- A tenant sending long prompts with a loose SLO (a flood within its limits) no longer sets
  another tenant's short-request TTFT: it yields, so its chunks add to a batch at most
  ``shared_step_fraction`` of the target and never join a batch with the other tenant's
  prefill; an arrival waits for one short step, under LARS, FCFS and Justitia alike.
- A lone application gets exactly the schedule it had before (its throughput is unchanged),
  and so does everyone once the other application has been quiet for the window.
- A request whose slack does not cover the slower pace keeps the whole budget.
"""

import pytest

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.offline_driver import Arrival, drive
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

TARGET_MS = 20.0
MS_PER_TOKEN = 0.05  # 400 tokens fill one 20 ms iteration; a quarter of it is 100 tokens
MODEL = AnalyticModel(ms_per_token=MS_PER_TOKEN, iteration_overhead_ms=0.0)


def make_scheduler(fraction: float, policy: str = "lars", window_s: float = 1.0) -> Scheduler:
    config = SchedulerConfig(policy=policy, target_batch_time_ms=TARGET_MS,
                             shared_step_fraction=fraction, shared_step_window_s=window_s)
    return Scheduler(config, BlockManager(40_000), predictor=MODEL)


def flood_and_victim(until_s: float = 2.0) -> list[Arrival]:
    # The flood: one 2,000-token prompt every 0.2 s with a 30 s TTFT objective (its tenant's
    # loosest class). The victim: 48-token prompts every 37 ms, 1 s objective.
    arrivals = [Arrival(f"flood{i}", 0.2 * i, 2000, 4, app_id="flood", ttft_s=30.0)
                for i in range(int(until_s / 0.2))]
    arrivals += [Arrival(f"victim{i}", 0.011 + 0.037 * i, 48, 4, app_id="victim", ttft_s=1.0)
                 for i in range(int(until_s / 0.037))]
    return arrivals


def ttfts(finished, prefix: str) -> list[float]:
    # victim0 arrives during a whole-budget chunk: until then the flood was alone.
    return [r.first_token_s - r.arrival_s for name, r in finished.items()
            if name.startswith(prefix) and name != "victim0"]


def flood_prefill_ms(batch) -> float:
    return sum(c.num_tokens for c in batch.chunks
               if not c.is_decode and c.request_id.startswith("flood")) * MS_PER_TOKEN


@pytest.mark.parametrize("policy", ["lars", "justitia", "fcfs"])
def test_a_flood_within_its_limits_no_longer_sets_the_other_tenants_ttft(policy):
    arrivals = flood_and_victim()
    shared_batches = []
    shared = drive(make_scheduler(0.25, policy), arrivals,
                   on_batch=lambda batch, now: shared_batches.append((now, batch))).finished
    whole = drive(make_scheduler(1.0, policy), arrivals).finished
    assert len(shared) == len(whole) == len(arrivals)  # everyone finishes, the flood too
    worst_shared, worst_whole = max(ttfts(shared, "victim")), max(ttfts(whole, "victim"))
    # Whole budgets: a victim can wait for a 20 ms flood chunk, then share a batch with the
    # next one. Short steps: it waits for at most one flood chunk of a quarter of the target,
    # then its own step (its 2.4 ms, the decodes, and at most a flood prompt's last short
    # chunk, which no longer yields).
    assert worst_whole >= 1.5 * TARGET_MS / 1000
    assert worst_shared <= (2 * 0.25 * TARGET_MS + 48 * MS_PER_TOKEN + 1.0) / 1000
    assert worst_shared <= 0.5 * worst_whole
    # Once the victim's tenant is known, no batch holds more than that of flood prefill,
    # and no victim prefills in a batch with more than a flood prompt's last short chunk.
    later = [batch for now, batch in shared_batches if now > 0.011]
    assert max(flood_prefill_ms(batch) for batch in later) <= 0.25 * TARGET_MS + 1e-6
    beside_victims = [c for batch in later
                      if any(v.request_id.startswith("victim") and not v.is_decode
                             for v in batch.chunks)
                      for c in batch.chunks if c.request_id.startswith("flood")
                      and not c.is_decode]
    assert all(c.end_pos == 2000 for c in beside_victims)
    # The flood's prefills take more steps but keep well within their objective.
    assert max(ttfts(shared, "flood")) < 30.0


def test_a_lone_application_gets_the_schedule_it_had():
    arrivals = [Arrival(f"doc{i}", 0.05 * i, 1500 + 100 * i, 8, ttft_s=30.0) for i in range(10)]
    arrivals += [Arrival(f"chat{i}", 0.013 * i, 40, 8, ttft_s=1.0) for i in range(30)]

    def chunks(fraction: float) -> list[tuple]:
        seen: list[tuple] = []
        drive(make_scheduler(fraction), arrivals, on_batch=lambda batch, now: seen.append(
            (round(now, 9), tuple((c.request_id, c.start_pos, c.num_tokens)
                                  for c in batch.chunks))))
        return seen

    assert chunks(0.25) == chunks(1.0)


def test_full_budgets_return_once_the_other_application_is_quiet_for_the_window():
    arrivals = [Arrival("victim", 0.0, 48, 2, app_id="victim", ttft_s=1.0),
                Arrival("flood", 0.0, 6000, 2, app_id="flood", ttft_s=30.0)]
    sizes: list[tuple[float, int]] = []

    def record(batch, now):
        sizes.extend((now, c.num_tokens) for c in batch.chunks if c.request_id == "flood")

    drive(make_scheduler(0.25, window_s=0.1), arrivals, on_batch=record)
    during = [size for now, size in sizes if now < 0.1]
    after = [size for now, size in sizes if now > 0.1 + TARGET_MS / 1000]
    assert during and max(during) <= 100
    assert after and max(after) > 300  # the whole budget again (in 32-token granules)


def test_a_request_without_slack_to_spare_keeps_the_whole_budget():
    # 4,000 tokens are 0.2 s of prefill at whole budgets; in quarter-budget steps they need
    # 0.8 s, more than its 0.5 s objective allows, so it keeps whole budgets next to the
    # other tenant, which keeps sending.
    arrivals = [Arrival("tight", 0.0, 4000, 1, app_id="a", ttft_s=0.5)]
    arrivals += [Arrival(f"other{i}", 0.05 * i, 16, 1, app_id="b", ttft_s=1.0)
                 for i in range(8)]
    sizes: list[int] = []
    drive(make_scheduler(0.25), arrivals, on_batch=lambda batch, now: sizes.extend(
        c.num_tokens for c in batch.chunks if c.request_id == "tight"))
    assert max(sizes) > 300


def test_the_fraction_is_validated():
    with pytest.raises(ValueError, match="shared_step_fraction"):
        SchedulerConfig(shared_step_fraction=0.0)
    with pytest.raises(ValueError, match="shared_step_window_s"):
        SchedulerConfig(shared_step_window_s=-1.0)
