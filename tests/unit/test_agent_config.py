"""The one path from a ServingReplica spec to the engine's configuration:

    spec --operator builders--> ConfigMap engine.yaml (a ServeConfig file) + pod command
         --slipstream serve's own parser--> ServeConfig --> EngineConfig, SchedulerConfig,
         ServerConfig
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.config.serve_config import ServeConfig
from slipstream.agent.server import cli_flags
from slipstream.agent.server import serve_configs
from slipstream.crds.agent_config import agent_config
from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.operator import builders, naming
from slipstream.operator.placement import NodeShare

SPEC = ServingReplicaSpec.model_validate({
    "model": {"name": "llama", "source": {"hostPath": {"path": "/models/llama"}},
              "dtype": "bfloat16", "maxModelLen": 8192},
    "image": "agent:1",
    "instances": 2,
    "parallelism": {"tp": 4, "spp": 2, "kvp": 2, "kvpTokensPerGroup": 65536},
    "pools": {"short": 1, "longPrefillThresholdTokens": 4096},
    "scheduler": {"policy": "edf", "targetBatchTimeMs": 40, "maxSpaceShareFraction": 0.25,
                  "longRequestThresholdTokens": 131072, "preemption": "swap",
                  "shortPrefillBatching": "awd", "shortPrefillMaxPromptTokens": 512,
                  "shortPrefillMaxWaitMs": 30, "shortPrefillMaxHeadWaitMs": 60.5},
    "slo": {"ttftSeconds": 0.5, "tpotMilliseconds": 40, "attainmentTarget": 0.95},
})


def serve_args_in_pod(spec: ServingReplicaSpec, mount_dir: Path, pod_ip: str = "10.0.0.7",
                      pool: str = "short") -> ServeConfig:
    """The config `slipstream serve` resolves in the controller pod: the ConfigMap's file at
    its mount path, the pod's command, and the downward-API environment."""
    config_map = builders.build_config_map_spec("chat", "ns", spec)
    for key, text in config_map["data"].items():
        (mount_dir / key).write_text(text)
    pod = builders.build_agent_pod_spec("chat", "ns", spec, instance="chat-0", index=0,
                                        incarnation="abcde", share=NodeShare("node-a", 8, 0),
                                        rank=0, num_ranks=2, pool=pool)
    container = pod["spec"]["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == builders.CONFIG_VOLUME]
    command = [part.replace(mount["mountPath"], str(mount_dir)) for part in container["command"]]
    assert command[:2] == ["slipstream", "serve"]
    return cli_flags.parse_serve_config(command[2:], {"POD_IP": pod_ip})


def test_the_spec_reaches_the_engine_scheduler_and_server_configs(tmp_path, monkeypatch):
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    monkeypatch.delenv("SLIPSTREAM_POOL", raising=False)
    args = serve_args_in_pod(SPEC, tmp_path)

    engine = serve_configs.engine_config(args)
    assert (engine.model_dir, engine.served_model_name, engine.dtype, engine.max_model_len) == \
        (Path("/models/llama"), "llama", "bfloat16", 8192)
    assert engine.parallel == ParallelConfig(tp=4, spp=2, kvp=2, kvp_tokens_per_group=65536)

    scheduler = serve_configs.scheduler_config(args)
    assert (scheduler.policy, scheduler.target_batch_time_ms, scheduler.max_space_share_fraction,
            scheduler.long_request_threshold_tokens, scheduler.preemption) == \
        ("edf", 40.0, 0.25, 131072, "swap")
    assert (scheduler.short_prefill_batching, scheduler.awd_max_prompt_tokens,
            scheduler.awd_max_wait_ms, scheduler.awd_max_head_wait_ms) == ("awd", 512, 30.0, 60.5)

    server = serve_configs.server_config(args)
    assert (server.host, server.port, server.control_port) == \
        ("10.0.0.7", naming.HTTP_PORT, naming.CONTROL_PORT)
    assert (server.long_prompt_threshold_tokens, server.slo_ttft_s, server.slo_tpot_ms,
            server.slo_attainment_target) == (4096, 0.5, 40.0, 0.95)


def test_a_spec_with_defaults_only_gives_the_agents_defaults(tmp_path):
    spec = ServingReplicaSpec.model_validate({
        "model": {"name": "m", "source": {"pvc": {"claimName": "models", "subPath": "llama/"}}},
        "image": "agent:1"})
    args = serve_args_in_pod(spec, tmp_path)
    plain = cli_flags.parse_serve_config([])
    assert serve_configs.engine_config(args).model_dir == Path("/models/llama")
    assert serve_configs.scheduler_config(args) == \
        serve_configs.scheduler_config(plain)
    server, plain_server = (serve_configs.server_config(a) for a in (args, plain))
    assert server.long_prompt_threshold_tokens == plain_server.long_prompt_threshold_tokens
    assert server.slo_attainment_target == plain_server.slo_attainment_target


def test_single_process_in_the_spec_runs_the_agents_engine_on_a_thread(tmp_path):
    """spec.singleProcess reaches `slipstream serve` as server.singleProcess, the same as
    --single-process; without it the agent runs its engine core in a process of its own."""
    split = serve_args_in_pod(SPEC, tmp_path)
    assert not split.server.single_process
    single_spec = SPEC.model_copy(update={"single_process": True})
    single = serve_args_in_pod(single_spec, tmp_path)
    assert single.server.single_process
    by_flag = cli_flags.parse_serve_config(["--single-process"])
    assert by_flag.server == cli_flags.parse_serve_config(["--no-engine-process"]).server
    assert single.server.single_process == by_flag.server.single_process
    # Everything else is as in the split layout's pod.
    assert single.changed(server={"single_process": False}) == split


def test_the_default_layout_leaves_the_agents_file_as_it_was():
    """Only a true singleProcess is written: the files, and so the template hashes, of
    replicas that keep the default did not change when the field came (an operator upgrade
    restarts nothing)."""
    assert "singleProcess" not in builders.agent_config(SPEC).to_tree(only_set=True)["server"]
    single_spec = SPEC.model_copy(update={"single_process": True})
    assert builders.agent_config(single_spec).to_tree(only_set=True)["server"][
        "singleProcess"] is True


def test_the_command_line_overrides_the_files_layout(tmp_path):
    path = tmp_path / "engine.yaml"
    single_spec = SPEC.model_copy(update={"single_process": True})
    path.write_text(agent_config(single_spec, "/models/llama").to_yaml(only_set=True))
    config = cli_flags.parse_serve_config(["--config", str(path), "--engine-process"])
    assert not config.server.single_process


DISAGGREGATED = ServingReplicaSpec.model_validate({
    "model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "agent:1",
    "disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 2},
                       "transport": "zmq", "holdTimeoutSeconds": 45, "blocksPerRead": 4}})


@pytest.mark.parametrize(("pool", "role"), [("unified", "prefill"), ("decode", "decode")])
def test_disaggregation_reaches_each_roles_agent(tmp_path, monkeypatch, pool, role):
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    monkeypatch.delenv("SLIPSTREAM_ROLE", raising=False)
    args = serve_args_in_pod(DISAGGREGATED, tmp_path, pool=pool)
    disagg = serve_configs.engine_config(args).disagg
    assert (disagg.role, disagg.transport, disagg.host, disagg.hold_timeout_s,
            disagg.blocks_per_read) == (role, "zmq", "10.0.0.7", 45.0, 4)
    # Prefill instances listen for decode instances on the port their pod declares.
    expected_port = naming.KV_SIDE_CHANNEL_PORT if role == "prefill" else 0
    assert disagg.side_channel_port == expected_port


def test_the_crd_offers_exactly_the_agents_kv_transports():
    from slipstream.agent.engine.disagg_config import TRANSPORTS
    from slipstream.crds.servingreplica import KV_TRANSPORTS

    assert KV_TRANSPORTS == TRANSPORTS


def test_every_field_of_the_crd_the_agent_reads_is_a_key_of_its_config():
    """A field added to the CRD's scheduler (or slo, parallelism, kvTiers) must reach the
    agent: the operator copies those sections whole, so the agent's config must know every
    key, and the full spec renders and loads."""
    from slipstream.crds.servingreplica import KVTiers, Parallelism, SchedulerSpec, Slo

    for section, crd_model in (("parallelism", Parallelism), ("scheduler", SchedulerSpec),
                               ("slo", Slo), ("kv_tiers", KVTiers)):
        section_type = ServeConfig.model_fields[section].annotation
        agent_keys = {field.alias for field in section_type.model_fields.values()}
        crd_keys = {field.alias for field in crd_model.model_fields.values()}
        assert crd_keys <= agent_keys, (section, crd_keys - agent_keys)


def test_every_setting_has_exactly_one_flag_and_help():
    parser = _serve_parser()
    dests = [action.dest for action in parser._actions if "." in action.dest]
    for section, section_field in ServeConfig.model_fields.items():
        for name, field in section_field.annotation.model_fields.items():
            assert f"{section}.{name}" in dests, f"{section}.{name} has no flag"
            assert field.description, f"{section}.{name} has no help"
    flags = [flag for action in parser._actions for flag in action.option_strings]
    assert len(flags) == len(set(flags))


def test_flags_on_the_command_line_override_the_file(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(agent_config(SPEC, "/models/llama").to_yaml(only_set=True))
    config = cli_flags.parse_serve_config(["--config", str(path), "--policy", "fcfs",
                                           "--tp", "1"])
    assert (config.scheduler.policy, config.parallelism.tp, config.parallelism.spp) == \
        ("fcfs", 1, 2)
    # What the flags left alone is the file's, not the default.
    assert config.scheduler.preemption == "swap"


@pytest.mark.parametrize("text, message", [
    ("model: {name: m, path: /m}\nscheduler: {polcy: lars}\n", "scheduler.polcy: unknown key"),
    ("parallelism: {tp: two}\n", "parallelism.tp (--tp): Input should be a valid integer"),
    ("model: [unclosed\n", "not YAML"),
    ("- model\n", "expected a mapping of sections"),
    ("modle: {path: /m}\n", "modle: unknown section"),
])
def test_a_bad_file_is_refused_in_one_line_naming_the_key(tmp_path, capsys, text, message):
    from slipstream.cli import main

    path = tmp_path / "engine.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"slipstream serve: error: --config {path}: " if "YAML" in message
                           or "mapping" in message else "slipstream serve: error: ")
    assert message in line


def _serve_parser():
    import argparse

    parser = argparse.ArgumentParser()
    cli_flags.add_arguments(parser)
    return parser


def test_the_weight_format_reaches_the_engine_and_is_left_out_when_default(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    spec = ServingReplicaSpec.model_validate({
        **SPEC.to_api(), "parallelism": {"tp": 1},
        "model": {"name": "llama", "source": {"hostPath": {"path": "/models/llama"}},
                  "quantization": "int4", "quantizationGroupSize": 32}})
    engine = serve_configs.engine_config(serve_args_in_pod(spec, tmp_path))
    assert (engine.quantization, engine.quantization_group_size) == ("int4", 32)
    model_file = agent_config(SPEC, "/models/llama").to_tree(only_set=True)["model"]
    assert "quantization" not in model_file and "quantizationGroupSize" not in model_file
    assert serve_configs.engine_config(
        serve_args_in_pod(SPEC, tmp_path)).quantization == "auto"


def test_expert_parallelism_reaches_the_engine_and_counts_in_the_world_size(tmp_path):
    spec = ServingReplicaSpec.model_validate({
        **SPEC.to_api(), "parallelism": {"tp": 2, "ep": 4}})
    assert spec.parallelism.gpus_per_instance == 8
    engine = serve_configs.engine_config(serve_args_in_pod(spec, tmp_path))
    assert engine.parallel == ParallelConfig(tp=2, ep=4)
    assert "ep" not in SPEC.parallelism.to_api()  # unset: the agent's file is unchanged
