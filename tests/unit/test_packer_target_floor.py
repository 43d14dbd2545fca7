"""A batch-time target below what the model needs: the packer's floor (config.py).

Under a target that one running decode already fills, the packer gives a new prompt no chunk
(it runs an over-budget chunk only in an otherwise empty batch), so requests run one after
another. A default target is raised to twice a 128-token prefill; a chosen one is kept.
"""

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.config import SchedulerConfig, fit_target_to_model
from slipstream.agent.scheduler.offline_driver import Arrival, drive
from slipstream.agent.scheduler.predictor import AnalyticModel, model_floor_target_ms
from slipstream.agent.scheduler.scheduler import Scheduler

# A slow device: 60 ms of fixed cost per iteration, so one decode alone (60.5 ms) is over
# the usual 50 ms target.
SLOW = AnalyticModel(ms_per_token=0.5, iteration_overhead_ms=60.0)
FAST = AnalyticModel(ms_per_token=0.01, iteration_overhead_ms=1.0)


def test_floor_is_twice_a_128_token_prefill():
    assert model_floor_target_ms(SLOW) == 2 * (60.0 + 128 * 0.5)
    assert model_floor_target_ms(FAST) < 50.0


def test_a_default_target_is_raised_for_a_slow_model_and_kept_for_a_fast_one():
    default = SchedulerConfig(raise_target_to_model_floor=True)
    raised, warning = fit_target_to_model(default, SLOW)
    assert raised.target_batch_time_ms == model_floor_target_ms(SLOW)
    assert warning is not None and "one after another" in warning
    assert fit_target_to_model(default, FAST) == (default, None)


def test_a_chosen_target_is_kept_with_a_warning():
    chosen = SchedulerConfig(target_batch_time_ms=50.0)
    kept, warning = fit_target_to_model(chosen, SLOW)
    assert kept is chosen
    assert warning is not None and "wait for the running requests" in warning


def _first_token_of_second_request(config: SchedulerConfig) -> tuple[float, float]:
    config, _ = fit_target_to_model(config, SLOW)
    scheduler = Scheduler(config, BlockManager(4096), predictor=SLOW)
    finished = drive(scheduler, [Arrival("first", 0.0, 64, 60),
                                 Arrival("second", 0.5, 64, 4)]).finished
    return finished["second"].first_token_s, finished["first"].finished_s


def test_under_the_raised_target_a_new_prompt_is_prefilled_beside_a_running_decode():
    second_ttft_at, first_done_at = _first_token_of_second_request(
        SchedulerConfig(raise_target_to_model_floor=True))
    assert second_ttft_at < first_done_at
    assert second_ttft_at - 0.5 < 0.5  # a few iterations, not the first request's 60 tokens


def test_under_a_target_one_decode_fills_the_second_request_waits_for_the_first():
    second_ttft_at, first_done_at = _first_token_of_second_request(
        SchedulerConfig(target_batch_time_ms=50.0))
    assert second_ttft_at >= first_done_at
