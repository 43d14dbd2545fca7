"""``make device-check`` rehearsed on the CPU, as CI runs it: the same stages, servers, loads,
JSON and plot as on a GPU, with the tiny model and small loads, so the script cannot rot
between the rare runs on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.bench import device_check, device_probe, device_report


def test_the_rehearsal_writes_every_figure(tmp_path):
    assert device_check.main(["--out", str(tmp_path), "--rehearsal", "--budget-s", "600"]) == 0
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["rehearsal"] is True
    stages = report["stages"]
    assert stages["environment"]["copy_gb_per_s"] > 0
    assert stages["gpu_tests"] == {"skipped_stage": "no CUDA device"}
    serving = stages["serving"]
    for streams in (1, 4, 16):
        row = serving[f"streams_{streams}"]
        assert row["failed"] == 0 and row["completed"] == row["requests"], row
        assert row["output_tok_per_s"] > 0 and row["tpot_p50_ms"] > 0
    assert serving["long_prompt"]["completed"] and serving["long_prompt"]["ttft_s"] > 0
    # What the engine did meanwhile: the prompt's chunks, and steps that took time.
    steps = serving["long_prompt"]["engine_steps"]
    assert steps["prefill_chunks"] >= 1 and steps["steps"] >= steps["prefill_chunks"], steps
    assert 0 < steps["chunk_tokens_mean"] <= 2_048 and steps["step_ms_mean"] > 0, steps
    assert 0 < steps["step_s_total"] <= serving["long_prompt"]["duration_s"], steps
    assert serving["convoy_lars"]["engine_steps"]["prefill_chunks"] > 2, serving["convoy_lars"]
    # The measured runtime profile comes back with the report.
    assert list((tmp_path / "runtime-profiles").iterdir())
    for policy in ("lars", "fcfs"):
        convoy = serving[f"convoy_{policy}"]
        assert convoy["short_completed"] == convoy["short_sent"] > 0, convoy
        assert convoy["documents_completed"] == convoy["documents_sent"] == 2
    # The servers profiled themselves (auto-profile) with the dummy weights.
    assert "profiling failed" not in (tmp_path / "server-lars.log").read_text()
    # The quantized arm: the same model with int8 weights on the CPU (fp8 on a GPU).
    quantized = serving["quantized_streams_1"]
    assert serving["quantized"]["weights"] == "int8" and quantized["completed"] >= 4, quantized
    assert "int8" in (tmp_path / "server-quantized.log").read_text()
    goals = {row["goal"]: row for row in report["goals"]}
    assert len(goals) == 8 and all(row["met"] is not None for row in goals.values())
    assert goals["convoy: every request completes"]["met"] is True
    assert (tmp_path / "device_check.png").stat().st_size > 10_000


def test_goals_are_judged_from_the_figures():
    report = {"scale_streams": [1, 32, 256], "dtype": "bfloat16", "stages": {
        "environment": {"copy_gb_per_s": 4000.0},
        "serving": {"weight_bytes": 14_000_000_000,
                    "streams_1": {"tpot_p50_ms": 5.0},
                    "quantized": {"weights": "fp8"},
                    "quantized_streams_1": {"tpot_p50_ms": 3.2},
                    "streams_256": {"output_tok_per_s": 9000.0, "ttft_p50_s": 2.5},
                    "long_prompt": {"ttft_s": 8.0},
                    "convoy_lars": {"short_sent": 10, "short_completed": 10,
                                    "documents_sent": 2, "documents_completed": 2,
                                    "short_ttft_p99_s": 0.4},
                    "convoy_fcfs": {"short_sent": 10, "short_completed": 9,
                                    "documents_sent": 2, "documents_completed": 2,
                                    "short_ttft_p99_s": 6.0}}}}
    rows = {row["goal"]: row for row in device_report.goals(report)}
    # 14 GB at 4,000 GB/s is 3.5 ms; 5 ms is 1.43 of it.
    assert rows["batch-1 TPOT / weight-read time"]["value"] == pytest.approx(1.43, abs=0.01)
    assert rows["batch-1 TPOT / weight-read time"]["met"] is True
    assert rows["batch-1 TPOT, fp8 / bfloat16"]["value"] == 0.64  # 3.2 / 5.0
    assert rows["batch-1 TPOT, fp8 / bfloat16"]["met"] is False
    assert rows["most streams: output tok/s"]["met"] is True
    assert rows["most streams: TTFT p50 s"]["met"] is False
    assert rows["long prompt alone: TTFT s"]["met"] is True
    assert rows["convoy: every request completes"]["met"] is False  # one short missing
    assert rows["convoy: FCFS p99 / LARS p99"]["value"] == 15.0
    assert device_report.goals({"stages": {}})[0]["met"] is None  # nothing measured


def test_junit_counts_read_a_report(tmp_path: Path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="b" name="gone"><skipped/></testcase></testsuite></testsuites>')
    counts = device_probe.junit_counts(report)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failures"] == ["a::bad"]
    assert "none" in device_probe.junit_counts(tmp_path / "missing.xml")["report"]
