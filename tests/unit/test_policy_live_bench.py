"""The live policy benchmark's summary: SLO goodput counted against each request's deadline,
and the table with the issue's live goals (docs/scheduling.md)."""

from slipstream.bench.policy_live_bench import summarize, table


def records(ttfts: list[float], long_ttft: float) -> dict[str, dict]:
    out = {f"s{i}": {"ttft_s": t, "deadline_s": 0.5, "long": False, "e2e_s": t + 1.0,
                     "arrival_s": float(i)} for i, t in enumerate(ttfts)}
    out["long-0"] = {"ttft_s": long_ttft, "deadline_s": 3.0, "long": True, "e2e_s": long_ttft,
                     "arrival_s": 0.0}
    return out


def test_goodput_counts_first_tokens_within_their_own_deadline():
    summary = summarize(records([0.1, 0.4, 0.6, 2.0], long_ttft=2.5), duration_s=10.0)
    assert summary["slo_attained"] == 3  # 0.1, 0.4 and the long one (2.5 <= 3.0)
    assert summary["goodput_rps"] == 0.3 and summary["requests"] == 5
    assert summary["long_ttft_s"] == [2.5]


def test_the_table_orders_by_goodput_and_checks_the_live_goals():
    summary = {"fcfs": summarize(records([0.1, 9.0, 9.5, 10.0], long_ttft=4.0), 10.0),
               "lars": summarize(records([0.1, 0.2, 0.3, 0.4], long_ttft=5.0), 10.0),
               "edf": summarize(records([0.1, 0.1, 0.2, 8.0], long_ttft=4.0), 10.0)}
    summary["lars_p99_improvement_x"] = (summary["fcfs"]["short_ttft_p99_s"]
                                         / summary["lars"]["short_ttft_p99_s"])
    summary["lars_p50_over_edf_x"] = (summary["lars"]["short_ttft_p50_s"]
                                      / summary["edf"]["short_ttft_p50_s"])
    settings = {"duration_s": 10.0, "requests": 5, "rate_req_per_s": 0.4, "commit": "abc",
                "load_average_before": [0.1, 0, 0], "load_average_after": [1.0, 0, 0]}
    text = table(summary, settings)
    assert "| lars | 0.400 | 4/5 |" in text and "| fcfs | 0.100 | 1/5 |" in text
    assert "Goodput order: lars > edf > fcfs." in text
    assert "1.67x EDF's (goal <= 2)" in text  # 0.25 s against 0.15 s
    assert "better than FCFS's (goal >= 10)" in text and "commit abc" in text


def test_a_profile_measured_under_load_marks_the_table_not_valid():
    summary = {"lars": summarize(records([0.1, 0.2], long_ttft=1.0), 10.0)}
    settings = {"duration_s": 10.0, "requests": 3, "rate_req_per_s": 0.2,
                "load_average_before": [15.0, 0, 0], "load_average_after": [15.0, 0, 0]}
    assert "Not valid" not in table(summary, settings | {"profile_step_overhead_ms": 8.0})
    assert "Not valid" in table(summary, settings | {"profile_step_overhead_ms": 147.0})
