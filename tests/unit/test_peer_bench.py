"""The peer benchmark's workload and server command lines (the benchmark itself, which builds
llama.cpp, runs only under ``make bench-peer``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.bench import llamacpp, peer_bench
from slipstream.bench.local_process import ExitedDuringStartup


def test_convoy_workload_has_steady_shorts_and_long_documents_in_the_first_half():
    requests = peer_bench.convoy_workload(seed=3, duration_s=200.0, rate_per_s=0.5,
                                          long_count=3, long_tokens=8176)
    shorts = [r for r in requests if r.source == "short"]
    longs = [r for r in requests if r.source == "long"]
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert 70 <= len(shorts) <= 130  # Poisson, 100 expected
    assert all(32 <= r.prompt_tokens <= 256 and 16 <= r.output_tokens <= 48 for r in shorts)
    assert [r.arrival_s for r in longs] == pytest.approx([20.0, 60.0, 100.0])
    assert all(r.prompt_tokens == 8176 and r.output_tokens == 8 for r in longs)
    # shorts keep arriving after the last long document
    assert sum(r.arrival_s > longs[-1].arrival_s for r in shorts) > 20
    assert peer_bench.convoy_workload(3, 200.0, 0.5, 3, 8176) == requests  # seeded


def test_each_server_gets_the_same_threads_and_a_full_context(monkeypatch, tmp_path):
    started: list[tuple[list[str], dict]] = []

    class Running:
        def __init__(self, argv, log, url, env, timeout_s):
            started.append((argv, env))

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(peer_bench, "running", Running)
    monkeypatch.setattr(llamacpp, "running", Running)
    gguf = Path("model.gguf")
    profiles = {"none": tmp_path / "float", "auto": tmp_path / "q4_1"}
    for system in (peer_bench.System("l", "llama.cpp", gguf),
                   peer_bench.System("s", "slipstream", gguf, "fcfs"),
                   peer_bench.System("q", "slipstream", gguf, quantization="auto")):
        with peer_bench.serving(system, 2, profiles, tmp_path / "log", 2048,
                                slipstream_args=("--cpu-compile-batch-sizes", "1,2,4")) as url:
            assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    (llama, _), (ours, env), (q4_1, _) = started
    assert llama[llama.index("-t") + 1] == "2" and env["OMP_NUM_THREADS"] == "2"
    assert llama[llama.index("--parallel") + 1] == "32" and "--kv-unified" in llama
    assert int(llama[llama.index("-c") + 1]) >= peer_bench.CONTEXT_TOKENS
    assert ours[-2:] == q4_1[-2:] == ["--cpu-compile-batch-sizes", "1,2,4"]  # Slipstream's own
    assert "--cpu-compile-batch-sizes" not in llama
    assert ours[ours.index("--policy") + 1] == "fcfs"
    assert ours[ours.index("--max-space-share-fraction") + 1] == "0.0"  # FCFS: no sharing
    assert int(ours[ours.index("--num-kv-blocks") + 1]) * 16 >= peer_bench.CONTEXT_TOKENS
    # The float32 row and the Q4_1 row: each its weight format, each its own profile.
    assert ours[ours.index("--quantization") + 1] == "none"
    assert ours[ours.index("--profile") + 1] == str(tmp_path / "float")
    assert q4_1[q4_1.index("--quantization") + 1] == "auto"
    assert q4_1[q4_1.index("--profile") + 1] == str(tmp_path / "q4_1")


def test_slipstream_threads_can_differ_from_llamacpp(monkeypatch, tmp_path):
    envs: list[dict] = []

    class Running:
        def __init__(self, argv, log, url, env, timeout_s):
            envs.append(env)

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(peer_bench, "running", Running)
    system = peer_bench.System("s", "slipstream", Path("model.gguf"))
    with peer_bench.serving(system, 2, {"none": None}, tmp_path / "log", 2048,
                            slipstream_threads=1):
        pass
    assert envs[0]["OMP_NUM_THREADS"] == "1"


def test_agreement_counts_equal_tokens_and_the_first_divergence():
    from slipstream.bench.gguf_agreement import compare

    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    theirs = [[1, 2, 3, 4], [5, 0, 7, 8], [9, 9, 9]]
    result = compare(ours, theirs)
    assert result["first_divergence"] == [None, 1, 2]  # a shorter output diverges where it ends
    assert result["prompts_identical"] == 1
    assert result["tokens"] == 4 + 4 + 3 and result["share_equal"] == (4 + 3 + 2) / 11


@pytest.mark.parametrize("returncode,restarted", [(-11, True), (1, False)])
def test_llama_server_starts_again_without_repacking_only_after_a_crash(
        monkeypatch, tmp_path, returncode, restarted):
    """llama.cpp's AMX matmuls crash at start-up on some Xeons (llama.cpp #20824): after a
    SIGSEGV, llama-server starts once more with --no-repack and the caller is told; any other
    failure is raised as it was."""
    started: list[list[str]] = []

    class Running:
        def __init__(self, argv, log, url, env, timeout_s):
            self.argv = argv
            log.write_text("the server's log")

        def __enter__(self):
            started.append(self.argv)
            if len(started) == 1:
                raise ExitedDuringStartup("llama-server exited", returncode)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(llamacpp, "running", Running)
    log = tmp_path / "llama.log"
    if not restarted:
        with pytest.raises(ExitedDuringStartup):
            with llamacpp.llama_server(["llama-server", "-m", "m.gguf"], log, "url"):
                pass
        assert len(started) == 1
        return
    with llamacpp.llama_server(["llama-server", "-m", "m.gguf"], log, "url") as argv:
        assert argv == ["llama-server", "-m", "m.gguf", "--no-repack"]
    assert started == [["llama-server", "-m", "m.gguf"], argv]
    assert (tmp_path / "llama.crash.log").read_text() == "the server's log"
