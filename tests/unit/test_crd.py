"""The ServingReplica CRD: generated YAML in sync with the models, structural, and its CEL rules
evaluated (with cel-python, as the API server would) against valid and invalid specs."""

from __future__ import annotations

import copy
from pathlib import Path

import celpy
import pytest
import yaml

from slipstream.crds import generate
from slipstream.crds.servingreplica import ServingReplicaSpec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "charts" / "slipstream" / "examples").glob("servingreplica-*.yaml"))


def openapi_schema() -> dict:
    return generate.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# -- generation ---------------------------------------------------------------------------------

def test_checked_in_crd_yaml_matches_the_models():
    stale = generate.stale_files(REPO)
    assert stale == [], f"regenerate with `python -m slipstream.crds.generate`: {stale}"


def test_generator_check_mode_reports_drift(tmp_path):
    assert generate.main(["--root", str(tmp_path), "--check"]) == 1
    assert generate.main(["--root", str(tmp_path)]) == 0
    assert generate.main(["--root", str(tmp_path), "--check"]) == 0
    (tmp_path / "crds" / generate.CRD_FILE_NAME).write_text("tampered")
    assert generate.main(["--root", str(tmp_path), "--check"]) == 1


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


def test_schema_is_structural():
    for path, node in _walk(openapi_schema()):
        if not isinstance(node, dict) or path.endswith("x-kubernetes-validations"):
            continue
        for forbidden in ("$ref", "anyOf", "allOf", "oneOf", "title", "$defs", "const"):
            assert forbidden not in node, f"{forbidden} at {path}"
        if "properties" in node or "items" in node:
            assert "type" in node, f"untyped node at {path}"
        assert node.get("additionalProperties") is not False, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, f"OpenAPI v3.0 wants a boolean at {path}"


def test_subresources_and_printer_columns():
    version = generate.crd_manifest()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.instances"
    assert version["subresources"]["scale"]["statusReplicasPath"] == ".status.replicas"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == ".status.ready"
    assert columns["Short"] == ".status.pools.short"
    assert columns["Long"] == ".status.pools.long"
    assert columns["Phase"] == ".status.phase"
    assert columns["Age"] == ".metadata.creationTimestamp"
    status = openapi_schema()["properties"]["status"]["properties"]
    for field in ("ready", "replicas", "phase", "pools", "selector", "instances", "endpoint"):
        assert field in status


def test_defaults_fill_nested_objects():
    spec = openapi_schema()["properties"]["spec"]["properties"]
    assert spec["parallelism"]["default"] == {"tp": 1, "spp": 1, "kvp": 1,
                                              "kvpTokensPerGroup": 1048576}
    rebalance = spec["pools"]["properties"]["rebalance"]
    assert rebalance["default"]["weights"] == {"queue": 1.0, "sloDeviation": 1.0,
                                               "utilization": 0.25}
    assert spec["parallelism"]["properties"]["tp"]["default"] == 1
    assert spec["scheduler"]["properties"]["policy"]["default"] == "lars"
    assert "default" not in spec["pools"], "absent pools means no pools"


# -- CEL rules ----------------------------------------------------------------------------------

def apply_defaults(schema: dict, value):
    """The API server's structural defaulting, top-down; and, as its CEL bindings do,
    integers in ``type: number`` fields become doubles."""
    if schema.get("type") == "number" and isinstance(value, int):
        return float(value)
    if schema.get("type") == "object" and isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif schema.get("type") == "array" and isinstance(value, list):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def cel_errors(schema: dict, value, path: str = "spec") -> list[str]:
    """Messages of every failing x-kubernetes-validations rule under ``schema``."""
    environment = celpy.Environment()
    errors = []
    activation = {"self": celpy.json_to_cel(value)}
    for rule in schema.get("x-kubernetes-validations", []):
        program = environment.program(environment.compile(rule["rule"]))
        if not program.evaluate(activation):
            if "messageExpression" in rule:
                message = environment.program(environment.compile(rule["messageExpression"]))
                errors.append(str(message.evaluate(activation)))
            else:
                errors.append(rule["message"])
    if schema.get("type") == "object" and isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                errors += cel_errors(sub, value[name], f"{path}.{name}")
    elif schema.get("type") == "array" and isinstance(value, list):
        for item in value:
            errors += cel_errors(schema["items"], item, f"{path}[]")
    return errors


def validate(spec: dict) -> list[str]:
    schema = openapi_schema()["properties"]["spec"]
    return cel_errors(schema, apply_defaults(schema, copy.deepcopy(spec)))


VALID = {
    "model": {"name": "m", "source": {"hostPath": {"path": "/models/m"}}},
    "image": "agent:1",
    "instances": 4,
    "parallelism": {"tp": 4, "spp": 2},
    "pools": {"short": 2},
    "slo": {"ttftSeconds": 1.5, "tpotMilliseconds": 40.0},
}


def with_change(path: str, value) -> dict:
    spec = copy.deepcopy(VALID)
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return spec


def test_valid_spec_passes_every_rule():
    assert validate(VALID) == []
    for example in EXAMPLES:
        assert validate(yaml.safe_load(example.read_text())["spec"]) == [], example.name


INVALID = [
    # (change, value, the field the message must name)
    ("parallelism.tp", 3, "spec.parallelism.tp"),
    ("parallelism.spp", 6, "spec.parallelism.spp"),
    ("parallelism.kvp", 0, "spec.parallelism.kvp"),
    ("parallelism.tp", 16, "spec.placement.gpusPerNode"),  # a TP group larger than a node
    ("parallelism.ep", 3, "spec.parallelism.ep"),
    ("parallelism.ep", 4, "spec.placement.gpusPerNode"),  # tp 4 x ep 4: an EP group > a node
    ("parallelism.kvpTokensPerGroup", 1000, "spec.parallelism.kvpTokensPerGroup"),
    ("model.source", {"hostPath": {"path": "/m"}, "pvc": {"claimName": "c"}},
     "spec.model.source"),
    ("model.source", {}, "spec.model.source"),
    ("pools.short", 5, "spec.pools.short"),  # more than instances
    ("pools.short", 4, "minPerPool"),  # long pool empty while rebalancing
    ("scheduler.policy", "round-robin", "spec.scheduler.policy"),
    ("scheduler.preemption", "drop", "spec.scheduler.preemption"),
    ("scheduler.maxSpaceShareFraction", 1.5, "spec.scheduler.maxSpaceShareFraction"),
    ("slo.ttftSeconds", 0.0, "spec.slo.ttftSeconds"),
    ("slo.tpotMilliseconds", -5.0, "spec.slo.tpotMilliseconds"),
    ("slo.attainmentTarget", 1.2, "spec.slo.attainmentTarget"),
    ("slo.attainmentTarget", 1.0, "spec.slo.attainmentTarget"),
    ("placement.gpuResource", "gpu", "spec.placement.gpuResource"),
    ("model.dtype", "int3", "spec.model.dtype"),
    ("model.quantization", "int3", "spec.model.quantization"),
    ("model.quantizationGroupSize", 48, "spec.model.quantizationGroupSize"),
    ("pools.rebalance", {"periodSeconds": 60, "cooldownSeconds": 30},
     "spec.pools.rebalance.cooldownSeconds"),
    ("scheduler.shortPrefillBatching", "always", "spec.scheduler.shortPrefillBatching"),
    ("scheduler.shortPrefillMaxPromptTokens", 100, "spec.scheduler.shortPrefillMaxPromptTokens"),
    ("scheduler.shortPrefillMaxWaitMs", -1.0, "spec.scheduler.shortPrefillMaxWaitMs"),
    ("scheduler", {"shortPrefillMaxWaitMs": 80.0}, "spec.scheduler.shortPrefillMaxHeadWaitMs"),
    ("scheduler", {"shortPrefillBatching": "awd", "shortPrefillMaxPromptTokens": 8192},
     "spec.pools.longPrefillThresholdTokens"),  # AWD would hold long-pool prompts
    ("autoscaling", {"minInstances": 5, "maxInstances": 4}, "spec.autoscaling.minInstances"),
    ("autoscaling", {"minInstances": 0, "maxInstances": 4}, "spec.autoscaling.minInstances"),
    ("autoscaling", {"maxInstances": 8, "maxStep": 0}, "spec.autoscaling.maxStep"),
    ("autoscaling", {"maxInstances": 8, "tolerance": 1.0}, "spec.autoscaling.tolerance"),
    ("autoscaling", {"maxInstances": 8, "periodSeconds": 30,
                     "scaleDownStabilizationSeconds": 10},
     "spec.autoscaling.scaleDownStabilizationSeconds"),
    ("autoscaling", {"maxInstances": 8, "scaleUpStabilizationSeconds": -1},
     "spec.autoscaling.scaleUpStabilizationSeconds"),
    ("autoscaling", {"maxInstances": 8, "forecastSeconds": -1},
     "spec.autoscaling.forecastSeconds"),
    ("autoscaling", {"maxInstances": 8, "forecastWindowSeconds": 10},
     "spec.autoscaling.forecastWindowSeconds"),
    ("autoscaling", {"maxInstances": 8, "targets": {"ttftAttainment": 1.5}},
     "spec.autoscaling.targets.ttftAttainment"),
    ("autoscaling", {"maxInstances": 8, "targets": {"tpotAttainment": 0.0}},
     "spec.autoscaling.targets.tpotAttainment"),
    ("autoscaling", {"maxInstances": 8, "targets": {"queueDelaySeconds": 0.0}},
     "spec.autoscaling.targets.queueDelaySeconds"),
    ("autoscaling", {"maxInstances": 8, "targets": {"kvUtilization": 1.2}},
     "spec.autoscaling.targets.kvUtilization"),
    ("autoscaling", {"maxInstances": 8, "targets": {"prefillLoad": 0.0}},
     "spec.autoscaling.targets.prefillLoad"),
    # With pools (short: 2, minPerPool 1), minInstances must hold both pools.
    ("autoscaling", {"minInstances": 1, "maxInstances": 8}, "spec.pools.short"),
    ("autoscaling", {"minInstances": 2, "maxInstances": 8}, "spec.autoscaling.minInstances"),
]


@pytest.mark.parametrize(("path", "value", "named_field"), INVALID,
                         ids=[f"{p}={v}" for p, v, _ in INVALID])
def test_invalid_spec_is_rejected_with_a_message_naming_the_field(path, value, named_field):
    errors = validate(with_change(path, value))
    assert errors, f"{path}={value!r} passed every rule"
    assert any(named_field in error for error in errors), errors


def test_short_prefill_batching_settings_pass_when_consistent():
    assert validate(with_change("scheduler", {
        "shortPrefillBatching": "awd", "shortPrefillMaxPromptTokens": 4096,
        "shortPrefillMaxWaitMs": 80.0, "shortPrefillMaxHeadWaitMs": 120.0})) == []
    # Off, the prompt limit does not matter, even above the pool threshold.
    assert validate(with_change("scheduler", {"shortPrefillMaxPromptTokens": 8192})) == []


def test_pool_split_is_free_without_rebalancing():
    spec = with_change("pools", {"short": 4, "rebalance": {"enabled": False}})
    assert validate(spec) == []


def test_autoscaling_ignores_instances_and_checks_pools_against_min_instances():
    autoscaled = with_change("autoscaling", {"minInstances": 3, "maxInstances": 12})
    assert validate(autoscaled) == []
    # spec.instances is ignored while autoscaling: its pool rules no longer bind ...
    autoscaled["instances"] = 1
    assert validate(autoscaled) == []
    # ... and hold again when autoscaling is switched off.
    autoscaled["autoscaling"]["enabled"] = False
    assert any("spec.pools.short" in error for error in validate(autoscaled))


def test_autoscaling_defaults_are_documented_values():
    schema = openapi_schema()["properties"]["spec"]
    spec = apply_defaults(schema, with_change("autoscaling", {"maxInstances": 6}))
    autoscaling = spec["autoscaling"]
    assert autoscaling["minInstances"] == 1 and autoscaling["maxStep"] == 2
    assert autoscaling["scaleUpStabilizationSeconds"] == 0
    assert autoscaling["scaleDownStabilizationSeconds"] == 300
    assert autoscaling["targets"] == {"ttftAttainment": 0.95, "tpotAttainment": 0.95,
                                      "queueDelaySeconds": 0.5, "kvUtilization": 0.8,
                                      "prefillLoad": 0.67}
    assert autoscaling["forecastSeconds"] == 75
    assert autoscaling["forecastWindowSeconds"] == 120
    parsed = ServingReplicaSpec.model_validate(spec)
    assert parsed.autoscaled and parsed.autoscaling is not None
    assert parsed.autoscaling.targets.queue_delay_seconds == 0.5


# -- the models ---------------------------------------------------------------------------------

@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_examples_parse_into_the_models(example):
    manifest = yaml.safe_load(example.read_text())
    assert manifest["apiVersion"] == "slipstream.dev/v1alpha1"
    assert manifest["kind"] == "ServingReplica"
    spec = ServingReplicaSpec.model_validate(manifest["spec"])
    assert spec.instances >= 2 or (spec.autoscaling is not None
                                   and spec.autoscaling.max_instances >= 2) or \
        (spec.disaggregation is not None and spec.disaggregation.instances >= 2)
    assert spec.to_api()["model"]["name"] == manifest["spec"]["model"]["name"]


@pytest.mark.parametrize("name", ["hpa-servingreplica.yaml", "keda-scaledobject.yaml"])
def test_hpa_and_keda_examples_drive_the_scale_subresource(name):
    manifest = yaml.safe_load((REPO / "charts" / "slipstream" / "examples" / name).read_text())
    target = manifest["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("slipstream.dev/v1alpha1", "ServingReplica")
    scale = generate.crd_manifest()["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.instances"
    basic = yaml.safe_load((REPO / "charts" / "slipstream" / "examples" /
                            "servingreplica-basic.yaml").read_text())
    assert target["name"] == basic["metadata"]["name"]
    assert "autoscaling" not in basic["spec"], "HPA/KEDA and the built-in autoscaler fight"


def test_wire_names_are_camel_case_and_python_names_snake_case():
    spec = ServingReplicaSpec.model_validate(with_change("parallelism.kvpTokensPerGroup", 4096))
    assert spec.parallelism.kvp_tokens_per_group == 4096
    assert spec.to_api()["parallelism"]["kvpTokensPerGroup"] == 4096
    assert spec.parallelism.gpus_per_instance == 8


# -- disaggregation -----------------------------------------------------------------------------

DISAGGREGATED = {
    "model": {"name": "m", "source": {"hostPath": {"path": "/models/m"}}},
    "image": "agent:1",
    "disaggregation": {"prefill": {"instances": 2}, "decode": {"instances": 3}},
}


def disaggregated(**changes) -> dict:
    spec = copy.deepcopy(DISAGGREGATED)
    spec.update(changes)
    return spec


def test_disaggregated_spec_passes_and_gets_the_documented_defaults():
    assert validate(DISAGGREGATED) == []
    schema = openapi_schema()["properties"]["spec"]
    parsed = ServingReplicaSpec.model_validate(apply_defaults(schema, copy.deepcopy(DISAGGREGATED)))
    assert parsed.disaggregation is not None and parsed.disaggregation.instances == 5
    assert (parsed.disaggregation.transport, parsed.disaggregation.hold_timeout_seconds,
            parsed.disaggregation.blocks_per_read) == ("mooncake", 120, 8)
    # Pools split the prefill instances: 1 short + 1 long of the 2.
    assert validate(disaggregated(pools={"short": 1})) == []


DISAGGREGATION_INVALID = [
    ({"disaggregation": {"prefill": {"instances": 0}, "decode": {"instances": 1}}},
     "spec.disaggregation.prefill.instances"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 0}}},
     "spec.disaggregation.decode.instances"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1},
                         "transport": "carrier-pigeon"}}, "spec.disaggregation.transport"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1},
                         "blocksPerRead": 0}}, "spec.disaggregation.blocksPerRead"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1},
                         "holdTimeoutSeconds": 0}}, "spec.disaggregation.holdTimeoutSeconds"),
    ({"autoscaling": {"maxInstances": 4}}, "spec.autoscaling"),
    ({"parallelism": {"tp": 2}}, "spec.disaggregation"),
    # 2 prefill instances cannot hold 3 short ones, nor leave the long pool its minPerPool.
    ({"pools": {"short": 3}}, "spec.disaggregation.prefill.instances"),
    ({"pools": {"short": 2}}, "minPerPool"),
]


@pytest.mark.parametrize(("changes", "named_field"), DISAGGREGATION_INVALID,
                         ids=[str(c) for c, _ in DISAGGREGATION_INVALID])
def test_invalid_disaggregation_is_rejected_naming_the_field(changes, named_field):
    errors = validate(disaggregated(**changes))
    assert errors, f"{changes} passed every rule"
    assert any(named_field in error for error in errors), errors


def test_pool_rules_count_prefill_instances_not_spec_instances():
    # spec.instances (default 1) is ignored with disaggregation: 2 prefill instances hold a
    # short and a long pool even though spec.instances alone could not.
    assert validate(disaggregated(instances=1, pools={"short": 1})) == []
    assert validate(disaggregated(instances=9, pools={"short": 3}))


def test_printer_columns_show_both_roles():
    version = generate.crd_manifest()["spec"]["versions"][0]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Prefill"] == ".status.disaggregation.prefill.ready"
    assert columns["Decode"] == ".status.disaggregation.decode.ready"
    status = openapi_schema()["properties"]["status"]["properties"]
    assert set(status["disaggregation"]["properties"]) == {"prefill", "decode"}


def test_kv_tiers_are_validated():
    single = {**VALID, "instances": 1, "parallelism": {"tp": 1}, "pools": None}
    del single["pools"]
    tiers = {"hostMemory": "1TiB", "diskPath": "/var/cache/kv", "diskSize": "2TiB"}
    assert validate({**single, "kvTiers": tiers}) == []
    assert validate({**single, "kvTiers": {"hostMemory": "512GiB"}}) == []
    for bad, field in ((dict(tiers, hostMemory="1T B"), "spec.kvTiers.hostMemory"),
                       (dict(tiers, hostMemory="64"), "spec.kvTiers.hostMemory"),
                       (dict(tiers, diskSize="lots"), "spec.kvTiers.diskSize"),
                       (dict(tiers, diskPath="cache"), "spec.kvTiers.diskPath"),
                       ({"hostMemory": "1TiB", "diskPath": "/kv"}, "spec.kvTiers.diskSize")):
        errors = validate({**single, "kvTiers": bad})
        assert any(field in error for error in errors), (bad, errors)
    errors = validate({**VALID, "kvTiers": {"hostMemory": "1TiB"}})  # tp 4, spp 2
    assert any("spec.kvTiers needs" in error for error in errors), errors
