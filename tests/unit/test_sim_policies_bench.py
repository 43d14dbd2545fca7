"""The policy comparison behind `make bench-sim` (bench/sim_policies.py): running its
simulations in worker processes gives the same numbers as running them one after another, and
the results name the commit they came from."""

import json

from slipstream.bench import sim_policies

ARGS = ["--name", "t", "--recipe", "medha-mixed", "--loads", "0.8", "--duration-s", "20",
        "--horizon-s", "40", "--long-prompt-tokens", "2048"]


def load(path):
    report = json.loads(path.read_text())
    for summaries in report["loads"].values():
        for summary in summaries.values():
            summary.pop("sim")  # wall time differs from run to run
    return report


def test_worker_processes_give_the_same_numbers_and_the_results_name_their_commit(tmp_path):
    sim_policies.main([*ARGS, "--out", str(tmp_path / "serial")])
    sim_policies.main([*ARGS, "--jobs", "2", "--out", str(tmp_path / "parallel")])
    serial, parallel = load(tmp_path / "serial" / "t_results.json"), load(
        tmp_path / "parallel" / "t_results.json")
    assert serial == parallel
    summaries = serial["loads"]["0.8"]
    assert set(summaries) == set(sim_policies.MAIN_POLICIES)
    assert summaries["lars"]["requests"] >= 8
    assert "source" in serial["settings"] and "commit" in serial["settings"]["source"]
    tables = (tmp_path / "serial" / "t_tables.md").read_text()
    assert "lars-classic" in tables and "goal" in tables
    assert (tmp_path / "parallel" / "t_ttft_cdf_q0.8.png").stat().st_size > 0
