"""``bench serve`` metrics follow vLLM's definitions; checked on hand-made streams."""

from __future__ import annotations

import pytest

from slipstream.bench.serve_metrics import RequestTiming, parse_goodput, serving_metrics


def stream(send_s: float, chunk_times_s: list[float], output_tokens: int,
           prompt_tokens: int = 100) -> RequestTiming:
    return RequestTiming(send_s=send_s, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                         chunk_times_s=chunk_times_s, success=True)


def test_per_request_definitions():
    # First chunk 0.3 s after sending; 5 tokens in 4 chunks (one chunk carries two tokens).
    timing = stream(1.0, [1.3, 1.35, 1.45, 1.7], output_tokens=5)
    assert timing.ttft_s == pytest.approx(0.3)
    assert timing.e2el_s == pytest.approx(0.7)
    assert timing.tpot_s == pytest.approx((0.7 - 0.3) / 4)  # (e2e - ttft) / (tokens - 1)
    assert timing.itls_s == pytest.approx([0.05, 0.1, 0.25])  # gaps between chunks


def test_single_token_request_has_no_tpot():
    assert stream(0.0, [0.2], output_tokens=1).tpot_s is None


def test_run_metrics_and_goodput():
    timings = [
        stream(0.0, [0.1, 0.2, 0.3], output_tokens=3),  # ttft 100 ms, tpot 100 ms
        stream(0.0, [0.5, 0.52, 0.54], output_tokens=3),  # ttft 500 ms, tpot 20 ms
        stream(1.0, [1.05], output_tokens=1),  # ttft 50 ms, no tpot (counts as 0 for goodput)
        RequestTiming(send_s=1.0, success=False, error="HTTP 500"),
    ]
    metrics = serving_metrics(timings, duration_s=2.0, goodput_slos={"ttft": 200, "tpot": 50},
                              percentiles=(50.0, 99.0))
    assert metrics["completed"] == 3 and metrics["failed"] == 1
    assert metrics["total_output_tokens"] == 7 and metrics["total_input_tokens"] == 300
    assert metrics["request_throughput"] == pytest.approx(1.5)
    assert metrics["output_throughput"] == pytest.approx(3.5)
    assert metrics["total_token_throughput"] == pytest.approx(153.5)
    assert metrics["mean_ttft_ms"] == pytest.approx((100 + 500 + 50) / 3)
    assert metrics["median_ttft_ms"] == pytest.approx(100)
    assert metrics["mean_tpot_ms"] == pytest.approx(60)  # the one-token request is left out
    assert metrics["mean_itl_ms"] == pytest.approx((100 + 100 + 20 + 20) / 4)
    assert metrics["p50_e2el_ms"] == pytest.approx(300)
    # Only the third meets both: the first misses TPOT, the second TTFT.
    assert metrics["request_goodput"] == pytest.approx(0.5)


def test_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft:0"])
