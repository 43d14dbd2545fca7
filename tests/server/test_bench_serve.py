"""``slipstream bench serve`` against a real ``slipstream serve`` over HTTP."""

from __future__ import annotations

import json

from slipstream.cli import main

NUM_REQUESTS = 12
OUTPUT_TOKENS = 6


def test_bench_serve_measures_a_live_server(server, tmp_path):
    out = tmp_path / "bench"
    code = main(["bench", "serve", "--base-url", f"{server.base_url}/v1", "--model", server.model,
                 "--input-len", "40", "--output-len", str(OUTPUT_TOKENS),
                 "--num-requests", str(NUM_REQUESTS), "--qps", "20", "--max-concurrency", "4",
                 "--goodput", "ttft:60000", "tpot:60000", "--percentiles", "50,99",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    metrics = json.loads((out / "serve.json").read_text())["metrics"]
    assert metrics["completed"] == NUM_REQUESTS and metrics["failed"] == 0
    # Output tokens come from the server's usage report: ignore_eos makes it exact.
    assert metrics["total_output_tokens"] == NUM_REQUESTS * OUTPUT_TOKENS
    assert metrics["total_input_tokens"] == NUM_REQUESTS * 40
    assert 0 < metrics["median_ttft_ms"] <= metrics["p99_ttft_ms"]
    assert metrics["mean_e2el_ms"] > metrics["mean_ttft_ms"]
    assert metrics["request_goodput"] == metrics["request_throughput"]  # generous SLOs
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == NUM_REQUESTS and all(r["success"] for r in rows)
    assert (out / "ttft_cdf.png").stat().st_size > 0
