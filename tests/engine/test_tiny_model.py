"""`slipstream make-tiny-model`: deterministic files that transformers loads as a Llama."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slipstream.agent.engine.models import tiny_model
from slipstream.agent.engine.models.tiny_model import (PRESETS, count_parameters,
                                                       ensure_default_model, write_tiny_model)
from slipstream.cli import main as cli_main

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(model_dir.iterdir())}


def test_same_seed_gives_identical_files_across_processes(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    # A fresh process has other hash seeds: the BPE training must not depend on them.
    again = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "slipstream.cli", "make-tiny-model", str(again),
                    "--seed", "0"], check=True, capture_output=True)
    assert _file_bytes(again) == _file_bytes(tiny_model_dir)


def test_other_seed_changes_weights_not_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "seed1"
    write_tiny_model(other, "tiny", seed=1)
    first, second = load_file(tiny_model_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert not torch.equal(first[name], second[name]), name
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_files_sizes_and_gqa_shapes(tiny_model_dir: Path) -> None:
    for name in MODEL_FILES:
        assert (tiny_model_dir / name).is_file(), name
    total_bytes = sum(path.stat().st_size for path in tiny_model_dir.iterdir())
    assert 1_000_000 < total_bytes < 8_000_000

    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["max_position_embeddings"] >= 4096
    assert config["tie_word_embeddings"] is False
    weights = load_file(tiny_model_dir / "model.safetensors")
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (kv_rows, config["hidden_size"])
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape[0] == (
        config["num_attention_heads"] * config["head_dim"])
    assert sum(tensor.numel() for tensor in weights.values()) == count_parameters(PRESETS["tiny"])
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
    norm = weights["model.norm.weight"]
    assert 0.8 < norm.mean().item() < 1.2 and norm.std().item() > 0.01


def test_100m_preset_is_about_100m_parameters() -> None:
    preset = PRESETS["100m"]
    assert 90e6 < count_parameters(preset) < 130e6
    assert preset.num_key_value_heads < preset.num_attention_heads


def test_transformers_loads_model_with_lively_logits(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    input_ids = tokenizer("The river ran quietly past the old mill", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids).logits[0]
    assert logits.shape == (input_ids.shape[1], PRESETS["tiny"].vocab_size)
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min().item() > 0.3  # not a near-uniform distribution
    assert len(set(logits.argmax(dim=-1).tolist())) > 1  # the prediction depends on the input


def test_cli_refuses_non_empty_dir_without_force(tmp_path: Path, capsys) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    assert cli_main(["make-tiny-model", str(target)]) == 2
    assert "--force" in capsys.readouterr().err
    assert not (target / "model.safetensors").exists()

    (target / "model.safetensors.index.json").write_text("{}")  # stale: would shadow ours
    assert cli_main(["make-tiny-model", str(target), "--force", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors" in printed and "MiB" in printed
    assert not (target / "model.safetensors.index.json").exists()
    assert (target / "notes.txt").read_text() == "keep me"


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        write_tiny_model(tmp_path / "x", "huge")


def test_ensure_default_model_builds_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(tiny_model.CACHE_DIR_ENV, str(tmp_path / "cache"))
    model_dir = ensure_default_model()
    assert model_dir == tmp_path / "cache" / "models" / "tiny-llama-seed0"
    assert all((model_dir / name).is_file() for name in MODEL_FILES)
    written_ns = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == written_ns
    assert [path.name for path in model_dir.parent.iterdir()] == ["tiny-llama-seed0"]


def test_ensure_default_model_rebuilds_outdated_format(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(tiny_model.CACHE_DIR_ENV, str(tmp_path))
    model_dir = tmp_path / "models" / "tiny-llama-seed0"
    model_dir.mkdir(parents=True)
    (model_dir / tiny_model.STAMP_FILE).write_text(json.dumps({"format_version": -1}))
    assert ensure_default_model() == model_dir
    assert (model_dir / "model.safetensors").is_file()
    assert [path.name for path in model_dir.parent.iterdir()] == ["tiny-llama-seed0"]


def test_cache_dir_is_the_variable_else_the_xdg_user_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(tiny_model.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny_model.slipstream_cache_dir() == tmp_path / "xdg" / "slipstream"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # invalid per the spec: ignored
    assert tiny_model.slipstream_cache_dir() == Path.home() / ".cache" / "slipstream"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tiny_model.slipstream_cache_dir() == Path.home() / ".cache" / "slipstream"
    monkeypatch.setenv(tiny_model.CACHE_DIR_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny_model.slipstream_cache_dir() == tmp_path / "mine"
