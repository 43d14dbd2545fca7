"""The one serve config: --print-config round-trips through --config, the layers compose
(defaults < environment < file < flags), bad settings are one line naming the key, and the
operator's rendered file is a config the agent loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from slipstream.agent.config.serve_config import ConfigError, ServeConfig
from slipstream.agent.server import cli_flags
from slipstream.cli import main
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders


def _print_config(argv: list[str], capsys, monkeypatch, environ: dict | None = None) -> str:
    for variable in ("POD_IP", "SLIPSTREAM_POOL", "SLIPSTREAM_ROLE"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in (environ or {}).items():
        monkeypatch.setenv(variable, value)
    assert main(["serve", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


OVERRIDES = ["--model", "tiny", "--max-num-seqs", "64", "--policy", "srpt", "--tp", "2",
             "--no-prefix-caching", "--single-process", "--kv-cache-memory", "2GiB",
             "--cuda-graph-lengths", "16,64", "--kv-host-memory", "8GiB",
             "--kv-disk-path", "/var/kv", "--kv-disk-size", "1TiB", "--slo-tpot-ms", "40",
             "--no-profile"]


@pytest.mark.parametrize("argv", [[], OVERRIDES], ids=["defaults", "overrides"])
def test_print_config_reads_back_to_the_same_config(tmp_path, capsys, monkeypatch, argv):
    printed = _print_config(argv, capsys, monkeypatch, {"POD_IP": "10.0.0.9"})
    path = tmp_path / "serve.yaml"
    path.write_text(printed)
    # Without the environment: the file carries what it resolved to.
    again = _print_config(["--config", str(path)], capsys, monkeypatch)
    assert again == printed
    assert ServeConfig.load(path) == cli_flags.parse_serve_config(argv, {"POD_IP": "10.0.0.9"})
    assert ServeConfig.load(path).server.host == "10.0.0.9"


def test_the_overrides_reach_their_sections(capsys, monkeypatch):
    tree = yaml.safe_load(_print_config(OVERRIDES, capsys, monkeypatch))
    assert tree["scheduler"]["maxNumSeqs"] == 64 and tree["scheduler"]["policy"] == "srpt"
    assert tree["scheduler"]["prefixCaching"] is False and tree["scheduler"]["autoProfile"] is False
    assert tree["parallelism"]["tp"] == 2 and tree["server"]["singleProcess"] is True
    assert tree["engine"]["cudaGraphLengths"] == [16, 64]
    assert tree["kvTiers"] == {"hostMemory": "8GiB", "diskPath": "/var/kv", "diskSize": "1TiB"}


def test_a_file_key_and_a_flag_compose_and_the_flag_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("scheduler:\n  maxNumSeqs: 32\n  policy: edf\nparallelism: {spp: 2}\n")
    config = cli_flags.parse_serve_config(["--config", str(path), "--policy", "fcfs",
                                           "--max-batched-tokens", "1024"])
    assert (config.scheduler.max_num_seqs, config.scheduler.policy,
            config.scheduler.max_batched_tokens, config.parallelism.spp) == (32, "fcfs", 1024, 2)
    # Untouched keys keep their defaults.
    assert config.scheduler.preemption == ServeConfig().scheduler.preemption


def test_the_environment_sits_between_the_defaults_and_the_file(tmp_path):
    environ = {"POD_IP": "10.0.0.7", "SLIPSTREAM_POOL": "long", "SLIPSTREAM_ROLE": "decode"}
    config = cli_flags.parse_serve_config([], environ)
    assert (config.server.host, config.pools.pool, config.disaggregation.role) == \
        ("10.0.0.7", "long", "decode")
    path = tmp_path / "serve.yaml"
    path.write_text("pools: {pool: short}\n")
    config = cli_flags.parse_serve_config(["--config", str(path), "--host", "0.0.0.0"], environ)
    assert (config.server.host, config.pools.pool, config.disaggregation.role) == \
        ("0.0.0.0", "short", "decode")
    assert cli_flags.parse_serve_config([], {}).server.host == "127.0.0.1"


@pytest.mark.parametrize("text, message", [
    ("scheduler: {maxNumSeq: 4}\n", "scheduler.maxNumSeq: unknown key (keys: "),
    ("scheduler: {maxNumSeqs: many}\n",
     "scheduler.maxNumSeqs (--max-num-seqs): Input should be a valid integer"),
    ("scheduler: {maxNumSeqs: 0}\n",
     "scheduler.maxNumSeqs (--max-num-seqs): Input should be greater than or equal to 1"),
    ("model: {dtype: fp4}\n", "model.dtype (--dtype): Input should be 'auto', "),
    ("engine: {kvCacheMemory: '7'}\n", "engine.kvCacheMemory (--kv-cache-memory): a bare "),
    ("server: {singleProcess: true, apiProcesses: 2}\n", "server.apiProcesses above 1 needs"),
    ("engine: 3\n", "engine: expected a mapping of settings"),
    ("scheduler: {profile: /p, autoProfile: false}\n", "profile and autoProfile: false"),
])
def test_a_bad_setting_in_the_file_is_one_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        ServeConfig.load(path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_bad_flag_value_is_one_line_too(capsys):
    assert main(["serve", "--tp", "0", "--print-config"]) == 2
    assert capsys.readouterr().err == ("slipstream serve: error: parallelism.tp (--tp): Input "
                                       "should be greater than or equal to 1, got 0\n")
    with pytest.raises(SystemExit) as exit_info:  # not an integer: argparse says so
        main(["serve", "--tp", "two"])
    assert exit_info.value.code == 2


def test_snake_case_keys_are_read_as_well(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("kv_tiers: {host_memory: 1GiB}\nscheduler: {max_num_seqs: 8}\n")
    config = ServeConfig.load(path)
    assert (config.kv_tiers.host_memory, config.scheduler.max_num_seqs) == ("1GiB", 8)


def test_help_shows_each_flags_default_file_key_and_examples(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-seqs N most requests running at once (default: 256; file: " \
           "scheduler.maxNumSeqs)" in text
    assert "--no-profile no profile: each iteration packs" in text
    assert "scheduler (file section 'scheduler')" in text
    assert "slipstream serve --config serve.yaml --port 9000" in text


# The agent-config files the operator wrote before the agent had one config (same specs,
# rendered by that operator): the text, and so every replica's template hash, must not move,
# or an operator upgrade would restart every agent pod.
OLD_RENDERINGS = Path(__file__).parent / "data" / "agent_config_renderings.json"


def test_the_operators_rendering_is_a_config_the_agent_loads_and_has_not_moved(tmp_path):
    recorded = json.loads(OLD_RENDERINGS.read_text())
    for name, spec_tree in recorded["specs"].items():
        spec = ServingReplicaSpec.model_validate(spec_tree)
        config_map = builders.build_config_map_spec("chat", "ns", spec)
        text = config_map["data"][builders.ENGINE_CONFIG_FILE]
        assert text == recorded["out"][name]["yaml"], name
        assert builders.template_hash(spec) == recorded["out"][name]["hash"], name
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        loaded = cli_flags.parse_serve_config(["--config", str(path)])
        assert loaded == builders.agent_config(spec)
        assert loaded.model.name == spec.model.name
        crd = spec.parallelism.model_dump()
        crd["ep"] = crd["ep"] or 1  # the CRD leaves it unset for dense models
        assert loaded.parallelism.model_dump() == crd


def test_the_configs_choices_are_the_engines_and_schedulers():
    import typing

    from slipstream.agent.engine.disagg_config import ROLES, TRANSPORTS
    from slipstream.agent.scheduler.config import (
        POLICY_NAMES, PREEMPTION_MODES, SHORT_PREFILL_BATCHING_MODES)
    from slipstream.agent.server.tool_parsers import PARSERS

    def choices(section: str, key: str) -> set:
        annotation = ServeConfig.model_fields[section].annotation.model_fields[key].annotation
        return set(typing.get_args(annotation))

    assert choices("scheduler", "policy") == set(POLICY_NAMES)
    assert choices("scheduler", "preemption") == set(PREEMPTION_MODES)
    assert choices("scheduler", "short_prefill_batching") == set(SHORT_PREFILL_BATCHING_MODES)
    assert choices("disaggregation", "role") == set(ROLES)
    assert choices("disaggregation", "transport") == set(TRANSPORTS)
    assert choices("server", "tool_call_parser") == {"auto"} | set(PARSERS)


CHART_EXAMPLES = sorted((Path(__file__).parents[2] / "charts" / "slipstream" / "examples")
                        .glob("servingreplica-*.yaml"))


@pytest.mark.parametrize("example", CHART_EXAMPLES, ids=lambda path: path.name)
def test_the_charts_examples_render_files_the_agent_loads(example, tmp_path):
    """Each example ServingReplica, through the operator's ConfigMap and pod command, is a
    command line `slipstream serve` accepts, with the spec's settings in it."""
    assert CHART_EXAMPLES
    spec = ServingReplicaSpec.model_validate(yaml.safe_load(example.read_text())["spec"])
    text = builders.build_config_map_spec("r", "ns", spec)["data"][builders.ENGINE_CONFIG_FILE]
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    command = builders.agent_command(rank=0, role=None)
    argv = [str(path) if part.endswith(builders.ENGINE_CONFIG_FILE) else part
            for part in command[2:]]
    config = cli_flags.parse_serve_config(argv, {"POD_IP": "10.0.0.7"})
    assert config.model.name == spec.model.name
    assert config.scheduler.policy == spec.scheduler.policy
    assert config.parallelism.tp == spec.parallelism.tp
    assert config.server.host == "10.0.0.7" and not config.scheduler.auto_profile
