"""The agent side of the control API without a model: load window arithmetic and the generated
protobuf module in sync with control.proto. (tests/server/test_control_api.py calls the gRPC
service of a real `slipstream serve`.)"""

from __future__ import annotations

import pytest

from slipstream.agent.engine.step.stats import EngineStats
from slipstream.agent.engine.step.load_window import LoadWindow
from slipstream.contracts import control_codegen


def test_utilization_is_the_busy_share_of_the_window():
    window = LoadWindow(start_s=0.0, window_s=10.0)
    window.record_step(1.0, 2.0, prefill_tokens=0)
    window.record_step(3.0, 4.0, prefill_tokens=0)
    assert window.snapshot(4.0).utilization == pytest.approx(2.0 / 4.0), "young: uptime span"
    assert window.snapshot(10.0).utilization == pytest.approx(2.0 / 10.0)
    assert window.snapshot(12.5).utilization == pytest.approx(1.0 / 10.0), "first step aged out"
    assert window.snapshot(30.0).utilization == 0.0


def test_arrival_rate_of_prompt_tokens_over_the_window():
    window = LoadWindow(start_s=0.0, window_s=10.0)
    window.record_arrival(1.0, 300)
    window.record_arrival(4.0, 500)
    assert window.snapshot(5.0).arrival_prompt_tokens_per_s == pytest.approx(800 / 5.0), \
        "young: over its uptime"
    assert window.snapshot(12.0).arrival_prompt_tokens_per_s == pytest.approx(500 / 10.0)
    assert window.snapshot(30.0).arrival_prompt_tokens_per_s == 0.0


def test_prefill_rate_is_remembered_after_the_window_empties():
    window = LoadWindow(start_s=0.0, window_s=10.0)
    window.record_step(0.0, 0.5, prefill_tokens=500)
    window.record_step(0.5, 1.0, prefill_tokens=0)  # decode-only steps do not dilute it
    assert window.snapshot(1.0).prefill_tokens_per_s == pytest.approx(1000.0)
    assert window.snapshot(100.0).prefill_tokens_per_s == pytest.approx(1000.0)


def test_slo_deviation_is_the_mean_relative_overshoot():
    window = LoadWindow(start_s=0.0, window_s=10.0)
    window.record_first_token(1.0, ttft_s=0.5, target_s=1.0)  # met: 0
    window.record_first_token(2.0, ttft_s=3.0, target_s=1.0)  # 200 % late
    assert window.snapshot(2.0).slo_deviation == pytest.approx(1.0)
    assert window.snapshot(20.0).slo_deviation == 0.0


def test_attainment_counts_cover_the_window_only():
    window = LoadWindow(start_s=0.0, window_s=10.0)
    window.record_first_token(1.0, ttft_s=0.5, target_s=1.0)  # met
    window.record_first_token(2.0, ttft_s=1.0, target_s=1.0)  # met, exactly on time
    window.record_first_token(8.0, ttft_s=1.5, target_s=1.0)  # missed
    window.record_finish(3.0, tpot_s=0.05, target_s=0.04)  # missed
    window.record_finish(9.0, tpot_s=0.03, target_s=0.04)  # met
    snapshot = window.snapshot(9.0)
    assert (snapshot.first_tokens, snapshot.ttft_met) == (3, 2)
    assert (snapshot.finished, snapshot.tpot_met) == (2, 1)
    later = window.snapshot(14.0)  # the first two first tokens and the first finish aged out
    assert (later.first_tokens, later.ttft_met, later.finished, later.tpot_met) == (1, 0, 1, 1)
    empty = window.snapshot(100.0)
    assert (empty.first_tokens, empty.ttft_met, empty.finished, empty.tpot_met) == (0, 0, 0, 0)


def test_running_sums_agree_with_a_recount_over_a_long_busy_run():
    window = LoadWindow(start_s=0.0, window_s=5.0)
    steps = [(i * 0.004, i * 0.004 + 0.003, 64 if i % 7 == 0 else 0) for i in range(20_000)]
    for index, (start, end, tokens) in enumerate(steps):
        window.record_step(start, end, tokens)
        if index % 997 == 0:
            window.record_first_token(end, ttft_s=0.1 * (index % 5), target_s=0.2)
    now = steps[-1][1] + 0.5
    inside = [(s, e, t) for s, e, t in steps if e >= now - 5.0]
    busy = sum(max(0.0, e - max(s, now - 5.0)) for s, e, _ in inside)
    rate = sum(t for *_, t in inside) / sum(e - s for s, e, t in inside if t)
    snapshot = window.snapshot(now)
    assert snapshot.utilization == pytest.approx(busy / 5.0, rel=1e-9)
    assert snapshot.prefill_tokens_per_s == pytest.approx(rate, rel=1e-9)
    assert window.snapshot(now + 60.0).utilization == 0.0


def test_queue_backlog_seconds_prices_tokens_at_the_prefill_rate():
    stats = EngineStats(num_waiting=3, num_running=1, kv_blocks_used=0, kv_blocks_total=10,
                        num_preemptions_total=0, backlog_prompt_tokens=4000,
                        prefill_tokens_per_s=2000.0)
    assert stats.queue_backlog_s == pytest.approx(2.0)
    unmeasured = EngineStats(0, 0, 0, 10, 0, backlog_prompt_tokens=500)
    assert unmeasured.queue_backlog_s > 0, "a backlog is never free before the rate is known"


def test_generated_protobuf_module_matches_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    for generated in control_codegen.generate(tmp_path):
        checked_in = control_codegen.HERE / generated.name
        assert checked_in.read_text() == generated.read_text(), \
            "run python -m slipstream.contracts.control_codegen"
