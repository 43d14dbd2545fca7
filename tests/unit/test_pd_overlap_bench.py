"""The streaming hand-off benchmark's command line (the run itself is `make bench-pd-overlap`)."""

import pytest

from slipstream.bench import pd_overlap


def test_a_prompt_that_fits_one_chunk_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pd_overlap.main(["--out", str(tmp_path), "--prompt-tokens", "128",
                         "--chunk-tokens", "128"])
    assert exit_info.value.code == 2
    assert "nothing to overlap" in capsys.readouterr().err


def test_the_bench_model_has_blocks_worth_timing():
    preset = pd_overlap.BENCH_PRESET
    # K and V, fp32, 16 tokens a block: 512 KiB per block.
    assert preset.num_hidden_layers * preset.num_key_value_heads * preset.head_dim * 16 * 4 * 2 \
        == 512 * 1024
