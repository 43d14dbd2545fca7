"""The long-prefill memory benchmark's arithmetic and command line (the run itself is
`make bench-long-prefill-memory`)."""

import argparse

import pytest

from slipstream.bench import long_prefill_memory as bench
from slipstream.agent.engine.models.tiny_model import PRESETS


def test_the_kv_cache_of_a_32k_prompt_on_the_tiny_model_is_32_mib():
    # 4 layers x K and V x 2 KV heads x 16 dims x 4 bytes = 1 KiB a token.
    assert bench.kv_cache_bytes(PRESETS["tiny"], 32_768) == 32 * 2**20
    # A partial block still takes a whole one.
    assert bench.kv_cache_bytes(PRESETS["tiny"], 32_769) == 32 * 2**20 + 16 * 1024


def test_growth_is_the_peak_sample_over_the_startup_level():
    samples = [bench.Sample(0.0, 1_000_000_000), bench.Sample(0.5, 1_600_000_000),
               bench.Sample(1.0, 1_100_000_000)]
    summary = bench.growth_summary(1_000_000_000, samples, kv_bytes=50_000_000)
    assert summary["peak_rss_mb"] == pytest.approx(1600)
    assert summary["growth_mb"] == pytest.approx(600)
    assert summary["growth_beyond_kv_mb"] == pytest.approx(550)
    assert summary["meets_goal"] is False  # 600 MB > 512 MB
    below = bench.growth_summary(1_000_000_000, samples[:1], kv_bytes=0)
    assert below["growth_mb"] == 0 and below["meets_goal"] is True
    with pytest.raises(ValueError, match="no memory sample"):
        bench.growth_summary(1, [], kv_bytes=0)


def test_the_server_holds_exactly_the_prompt_and_chunks_it_by_the_token_budget():
    args = argparse.Namespace(prompt_tokens=32_768, chunk_tokens=8192)
    command = bench.serve_command(args, port=1234)

    def flag(name):
        return command[command.index(name) + 1]

    assert flag("--max-batched-tokens") == "8192" and "--no-profile" in command
    assert flag("--max-model-len") == str(32_768 + 1)  # the prompt and its one output token
    assert int(flag("--num-kv-blocks")) * 16 >= 32_768 + 1
    assert flag("--device") == "cpu" and flag("--model") == "tiny"


def test_a_prompt_that_fits_one_chunk_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path), "--prompt-tokens", "8192", "--chunk-tokens", "8192"])
    assert exit_info.value.code == 2
    assert "longer than one chunk" in capsys.readouterr().err
