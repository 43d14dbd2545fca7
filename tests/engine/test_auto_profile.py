"""The packer out of the box: `slipstream serve` without --profile profiles the engine on its
first start, caches the profile per model, dtype, device, threads and engine version, and
reads it back on the next start; --no-profile and --profile DIR skip it; a stale or corrupt
cache entry is measured again after a one-line warning.

The first-start test runs the real grid the server uses (``quick``) on the tiny model; the
tests that profile a second time use a smaller grid, so the file stays within a minute or two.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch

from slipstream.agent.engine.profile import auto_profile, profiler
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.profile.step_calibration import CalibrationLoad
from slipstream.agent.scheduler.predictor import (RuntimePredictor, TokenBudgetModel,
                                                  model_floor_target_ms)
from slipstream.agent.config.serve_config import ConfigError, ServeConfig
from slipstream.agent.server import cli_flags, serve_configs

TEST_GRID = profiler.ProfileGrid(
    tokens=(1, 16, 128), prefill_kv=(0, 256), prefill_chunk=(32, 128), decode_batch=(1, 8),
    decode_kv=(256, 1024), calibration_batches=2, calibration_repeats=1,
    engine_load=CalibrationLoad(waves=(1, 3), prompt_tokens=(16, 64), output_tokens=(4, 8)),
    max_point_ms=20.0)


def _parse(*argv: str) -> ServeConfig:
    return cli_flags.parse_serve_config(list(argv))


def _engine(args: ServeConfig) -> LLMEngine:
    """What `slipstream serve` builds in the process that runs the engine."""
    config = auto_profile.with_runtime_profile(serve_configs.engine_config(args))
    return LLMEngine(dataclasses.replace(config, num_kv_blocks=64),
                     serve_configs.scheduler_config(args))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slipstream-cache")


@pytest.fixture(scope="module")
def first_start(tiny_model_dir, cache_dir):
    """One real first start (the quick grid) into the module's cache: (log lines, seconds)."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(cache_dir))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("slipstream")
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    started = time.monotonic()
    try:
        engine = _engine(_parse("--model", str(tiny_model_dir), "--device", "cpu"))
        seconds = time.monotonic() - started
        assert isinstance(engine.scheduler.model, RuntimePredictor)
        engine.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
        monkeypatch.undo()
    return records, seconds


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(path for path in (cache_dir / "runtime-profiles").iterdir() if path.is_dir())


def test_first_start_profiles_into_the_cache_and_uses_the_time_budget_packer(
        first_start, cache_dir, tiny_model_dir):
    records, _ = first_start
    assert any(line.startswith("first start of tiny-llama on this device") for line in records)
    [entry] = _entries(cache_dir)
    # The default 50 ms target, or (on a machine slow enough that the tiny model's 128-token
    # prefill takes over 25 ms, e.g. under load) that model's floor, said in a warning.
    floor_ms = model_floor_target_ms(RuntimePredictor.from_directory(entry, cache_dir=None))
    expected_ms = max(50.0, floor_ms)
    budgets = [float(line.split()[4]) for line in records
               if line.startswith("packer: time budget of") and ".partial" not in line]
    assert budgets and abs(budgets[-1] - expected_ms) < 1e-3 * expected_ms
    assert (floor_ms > 50.0) == any("requests would run one after another" in line
                                    for line in records)
    assert entry.name.startswith("tiny-llama-cpu-float32-")
    key = json.loads((entry / "key.json").read_text())
    assert key["model"] == str(tiny_model_dir.resolve()) and key["dtype"] == "float32"
    assert key["device"].startswith("cpu:") and key["threads"] == torch.get_num_threads()
    assert "grid quick" in key["engine_version"]
    RuntimePredictor.from_directory(entry, cache_dir=None)  # the tables load
    assert not list((cache_dir / "runtime-profiles").glob("*.partial"))


def test_second_start_reads_the_cache_without_profiling(first_start, cache_dir, tiny_model_dir,
                                                        monkeypatch, caplog):
    def must_not_profile(*args, **kwargs):
        raise AssertionError("profiled again although the cache holds a profile")

    monkeypatch.setattr(profiler, "profile", must_not_profile)
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(cache_dir))
    [entry] = _entries(cache_dir)
    before = (entry / "profile.json").stat().st_mtime_ns
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        engine = _engine(_parse("--model", str(tiny_model_dir), "--device", "cpu"))
    seconds = time.monotonic() - started
    assert isinstance(engine.scheduler.model, RuntimePredictor)
    engine.close()
    assert engine.scheduler.model.meta == RuntimePredictor.from_directory(
        entry, cache_dir=None).meta
    assert (entry / "profile.json").stat().st_mtime_ns == before
    assert any("(cached; the time-budget packer is on)" in record.getMessage()
               for record in caplog.records)
    assert not any(record.levelno >= logging.WARNING for record in caplog.records
                   if record.name.startswith("slipstream.agent.engine.profile.auto_profile"))
    assert seconds < first_start[1]


def test_no_profile_packs_the_fixed_token_budget(tiny_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    args = _parse("--model", str(tiny_model_dir), "--device", "cpu", "--no-profile",
                  "--max-batched-tokens", "300")
    assert not serve_configs.engine_config(args).auto_profile
    assert serve_configs.engine_config(_parse("--model", str(tiny_model_dir))).auto_profile
    with caplog.at_level(logging.INFO):
        engine = _engine(args)
    assert isinstance(engine.scheduler.model, TokenBudgetModel)
    engine.close()
    assert not (tmp_path / "runtime-profiles").exists()
    assert any(record.getMessage() == "packer: a fixed budget of 300 tokens per iteration "
               "(no runtime profile)" for record in caplog.records)


def test_a_given_profile_wins_over_the_cache(first_start, cache_dir, tiny_model_dir, tmp_path,
                                             monkeypatch):
    def must_not_profile(*args, **kwargs):
        raise AssertionError("profiled although --profile was given")

    monkeypatch.setattr(profiler, "profile", must_not_profile)
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "empty-cache"))
    [entry] = _entries(cache_dir)
    given = tmp_path / "given"
    given.mkdir()
    for path in entry.iterdir():
        (given / path.name).write_bytes(path.read_bytes())
    args = _parse("--model", str(tiny_model_dir), "--device", "cpu", "--profile", str(given))
    config = serve_configs.engine_config(args)
    assert not config.auto_profile
    assert auto_profile.with_runtime_profile(config).profile_dir == given
    assert not (tmp_path / "empty-cache").exists()
    with pytest.raises(ConfigError, match="exclude each other"):
        _parse("--profile", str(given), "--no-profile")  # one or the other


@pytest.fixture(scope="module")
def test_grid_entry(tiny_model_dir, tmp_path_factory):
    """(model dir, cache root, entry, a pristine copy of the entry) made with the test grid."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setitem(profiler.PROFILE_GRIDS, "test", TEST_GRID)
    base = tmp_path_factory.mktemp("test-grid")
    model_dir = base / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    try:
        entry = auto_profile.ensure_profile(model_dir, device="cpu", root=base / "profiles",
                                            grid="test")
    finally:
        monkeypatch.undo()
    pristine = base / "pristine"
    shutil.copytree(entry, pristine)
    return model_dir, base / "profiles", entry, pristine


def _test_key(model_dir: Path) -> auto_profile.ProfileKey:
    return auto_profile.profile_key(model_dir, "auto", "cpu", torch.get_num_threads(), "test")


@pytest.mark.parametrize("damage", ["truncated table", "missing profile.json", "stale version"])
def test_a_corrupt_or_stale_entry_is_profiled_again_after_one_warning(
        damage, test_grid_entry, monkeypatch, caplog):
    monkeypatch.setitem(profiler.PROFILE_GRIDS, "test", TEST_GRID)
    model_dir, root, entry, pristine = test_grid_entry
    shutil.rmtree(entry)
    shutil.copytree(pristine, entry)
    assert auto_profile.entry_problem(entry, _test_key(model_dir)) is None
    if damage == "truncated table":
        table = entry / "attn_decode.csv"
        table.write_text(table.read_text()[:20])
    elif damage == "missing profile.json":
        (entry / "profile.json").unlink()
    else:
        key = json.loads((entry / "key.json").read_text())
        (entry / "key.json").write_text(json.dumps({**key, "engine_version": "slipstream 0.0"}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="slipstream.agent.engine.profile.auto_profile"):
        again = auto_profile.ensure_profile(model_dir, device="cpu", root=root, grid="test")
    assert again == entry
    [warning] = [record.getMessage() for record in caplog.records
                 if record.levelno == logging.WARNING]
    assert warning.startswith(f"ignoring the cached runtime profile {entry}: ")
    assert warning.endswith("; profiling again") and "\n" not in warning
    expected = "stale (engine_version changed)" if damage == "stale version" else "corrupt ("
    assert f": {expected}" in warning
    assert any(record.getMessage().startswith("profiled model in ") for record in caplog.records)
    assert RuntimePredictor.from_directory(entry, cache_dir=None).meta.num_layers == 4
    assert auto_profile.entry_problem(entry, _test_key(model_dir)) is None


def test_changed_model_files_make_an_entry_stale(test_grid_entry, tmp_path):
    model_dir, _, entry, pristine = test_grid_entry
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    key = dataclasses.replace(_test_key(copy), model=_test_key(model_dir).model)
    assert auto_profile.entry_problem(pristine, key) is None  # same files, same sizes and times
    config = copy / "config.json"
    config.write_text(config.read_text() + "\n")
    changed = dataclasses.replace(_test_key(copy), model=key.model)
    assert auto_profile.entry_problem(pristine, changed) == "stale (model_files changed)"
    assert changed.entry_name("model") == key.entry_name("model")  # replaced in place
