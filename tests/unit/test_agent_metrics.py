"""Agent metrics without a server: the name registry follows Prometheus conventions, the step
observer turns hand-built batches into the right histograms, and request timers keep the
in-flight gauges and SLO outcomes straight."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats, StepStats
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.request import RequestSLO
from slipstream.contracts import metric_names
from slipstream.agent.server.metrics import ServingMetrics
from slipstream.agent.server.step_metrics import StepMetrics

UNIT_SUFFIXES = ("_seconds", "_tokens", "_ratio", "_info", "_blocks_used", "_blocks_capacity",
                 "_blocks_cached",
                 "_depth", "_degree", "_in_flight", "_instances", "_pressure")


def test_registry_names_follow_prometheus_conventions():
    specs = metric_names.AGENT_METRICS + metric_names.OPERATOR_METRICS + metric_names.ROUTER_METRICS
    assert len({spec.name for spec in specs}) == len(specs)
    for spec in specs:
        assert re.fullmatch(r"slipstream_[a-z0-9_]+", spec.name), spec.name
        if spec.type == "counter":
            assert spec.name.endswith("_total"), spec.name
        else:
            assert not spec.name.endswith("_total"), spec.name
            assert spec.name.endswith(UNIT_SUFFIXES), f"{spec.name}: no unit in the name"
        assert spec.help.endswith("."), spec.name
    assert all(s.name.startswith("slipstream_operator_") for s in metric_names.OPERATOR_METRICS)
    assert all(s.name.startswith("slipstream_router_") for s in metric_names.ROUTER_METRICS)


def test_family_of_resolves_histogram_series_only():
    assert metric_names.family_of("slipstream_time_to_first_token_seconds_bucket") is \
        metric_names.TTFT
    assert metric_names.family_of("slipstream_requests_total") is metric_names.REQUESTS
    assert metric_names.family_of("slipstream_queue_depth_count") is None  # a gauge
    assert metric_names.family_of("slipstream_nonexistent_seconds") is None


def _chunk(request_id: str, num_tokens: int, start_pos: int, sample: bool = True):
    return ScheduledChunk(request_id, tuple(range(num_tokens)), start_pos, (0,), sample)


def _samples(registry_text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(registry_text)
            for s in family.samples}


def _serving_metrics(**kwargs) -> ServingMetrics:
    stats = EngineStats(num_waiting=2, num_running=3, kv_blocks_used=10, kv_blocks_total=40,
                        num_preemptions_total=1)
    return ServingMetrics(lambda: stats, pool="short", long_prompt_threshold_tokens=100,
                          **kwargs)


def test_step_observer_records_chunks_batch_and_times():
    step_metrics = StepMetrics()
    batch = Batch(chunks=(_chunk("d1", 1, 50), _chunk("d2", 1, 7), _chunk("p1", 100, 0, False),
                          _chunk("p2", 40, 256)), predicted_time_s=0.020)
    step_metrics.observe(StepStats(batch, 10.0, 10.001, 10.026, 0.02))
    step_metrics.observe(StepStats(Batch(chunks=(_chunk("d1", 1, 51),)), 11.0, 11.0, 11.004, 0))
    text = "".join(f"{f.name} {s.name} {s.labels} {s.value}\n" for f in step_metrics.collect()
                   for s in f.samples)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in step_metrics.collect() for s in family.samples}
    chunk = "slipstream_prefill_chunk_tokens"
    assert values[(f"{chunk}_count", ())] == 2
    assert values[(f"{chunk}_sum", ())] == 140
    assert values[(f"{chunk}_bucket", (("le", "32.0"),))] == 0
    assert values[(f"{chunk}_bucket", (("le", "64.0"),))] == 1  # the 40-token chunk
    assert values[(f"{chunk}_bucket", (("le", "128.0"),))] == 2, text
    assert values[("slipstream_batch_tokens_sum", ())] == 143
    assert values[("slipstream_scheduled_tokens_total", (("phase", "decode"),))] == 3
    assert values[("slipstream_scheduled_tokens_total", (("phase", "prefill"),))] == 140
    assert values[("slipstream_batch_time_actual_seconds_count", ())] == 2
    assert values[("slipstream_batch_time_actual_seconds_sum", ())] == pytest.approx(0.029)
    assert values[("slipstream_batch_time_predicted_seconds_count", ())] == 1  # only when set
    assert values[("slipstream_batch_time_predicted_seconds_sum", ())] == pytest.approx(0.02)
    assert values[("slipstream_schedule_time_seconds_sum", ())] == pytest.approx(0.001)
    assert values[("slipstream_batch_time_actual_seconds_bucket", (("le", "+Inf"),))] == 2


def test_exposition_lists_exactly_the_registered_agent_metrics():
    text = _serving_metrics(default_slo=RequestSLO(ttft_s=1.0, tpot_s=0.05)).exposition()
    families = {family.name for family in text_string_to_metric_families(text.decode())}
    # The text parser strips _total from counter family names.
    expected = {spec.constructor_name for spec in metric_names.AGENT_METRICS}
    assert families == expected


def test_slo_gauges_exist_only_when_an_objective_is_configured():
    text = _serving_metrics().exposition().decode()
    assert "slipstream_slo_ttft_target_seconds" not in text
    assert "slipstream_slo_attainment_target_ratio 0.99" in text
    assert 'slipstream_pool_role_info{pool="short"} 1.0' in text


def test_ttft_buckets_include_the_objective_exactly():
    text = _serving_metrics(default_slo=RequestSLO(ttft_s=0.3)).exposition().decode()
    assert 'slipstream_time_to_first_token_seconds_bucket{le="0.3",pool="short",' \
           'request_class="short"}' in text


def _output(tokens: int, *, finished: bool = False, arrival_s=None, first_s=None, done_s=None):
    return RequestOutput("r", list(range(tokens)), "x" * tokens, 120, tokens, finished=finished,
                         finish_reason="length" if finished else None, arrival_s=arrival_s,
                         first_token_s=first_s, finished_s=done_s)


def test_request_timer_moves_a_request_through_the_in_flight_gauges():
    metrics = _serving_metrics(default_slo=RequestSLO(ttft_s=1.0, tpot_s=0.01))

    def in_flight(phase: str) -> float:
        return _samples(metrics.exposition().decode())[(
            "slipstream_requests_in_flight",
            (("phase", phase), ("pool", "short"), ("request_class", "long")))]

    timer = metrics.start_request(num_prompt_tokens=120, slo=None)  # >= 100: long
    assert (in_flight("prefill"), in_flight("decode")) == (1, 0)
    timer.on_output(_output(1))
    assert (in_flight("prefill"), in_flight("decode")) == (0, 1)
    # TTFT 0.5 s meets 1 s; TPOT (2.5 - 0.5) / 4 = 0.5 s misses 10 ms.
    timer.finish(_output(4, finished=True, arrival_s=100.0, first_s=100.5, done_s=102.5),
                 "length")
    timer.finish(None, "abort")  # recorded once only
    assert (in_flight("prefill"), in_flight("decode")) == (0, 0)
    samples = _samples(metrics.exposition().decode())
    outcome = {(slo, outcome): samples[("slipstream_slo_requests_total", (
        ("outcome", outcome), ("pool", "short"), ("request_class", "long"), ("slo", slo)))]
        for slo in ("ttft", "tpot", "all") for outcome in ("met", "missed")}
    assert outcome == {("ttft", "met"): 1, ("ttft", "missed"): 0, ("tpot", "met"): 0,
                       ("tpot", "missed"): 1, ("all", "met"): 0, ("all", "missed"): 1}
    assert samples[("slipstream_requests_total", (("finish_reason", "length"),))] == 1
    assert samples[("slipstream_requests_total", (("finish_reason", "abort"),))] == 0


def test_aborted_request_before_its_first_token_leaves_the_prefill_gauge():
    metrics = _serving_metrics()
    timer = metrics.start_request(num_prompt_tokens=5, slo=None)
    timer.finish(None, "abort")
    samples = _samples(metrics.exposition().decode())
    assert samples[("slipstream_requests_in_flight", (("phase", "prefill"), ("pool", "short"),
                                                      ("request_class", "short")))] == 0
    assert samples[("slipstream_slo_requests_total", (
        ("outcome", "met"), ("pool", "short"), ("request_class", "short"), ("slo", "all")))] == 0


def test_request_slo_fields_override_the_default_one_by_one():
    metrics = _serving_metrics(default_slo=RequestSLO(ttft_s=2.0, tpot_s=0.05))
    assert metrics.effective_slo(RequestSLO(ttft_s=0.5)) == RequestSLO(ttft_s=0.5, tpot_s=0.05)
    assert metrics.effective_slo(None) == RequestSLO(ttft_s=2.0, tpot_s=0.05)
    assert _serving_metrics().effective_slo(None) is None
