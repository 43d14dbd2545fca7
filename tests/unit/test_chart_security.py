"""The whole chart rendered by ``helm template``: NetworkPolicies, the operator's hardened
pod, the control-plane master key and the least-privilege grant on Secrets (issue 30). helm
comes as in test_dashboards.py (fetched on a fresh machine); these skip only if that fails."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.unit.test_dashboards import CHART, _helm


def render(*sets: str) -> list[dict]:
    helm = _helm()
    if helm is None:
        pytest.skip("helm not found (set SLIPSTREAM_HELM or put helm on PATH; e2e builds it)")
    argv = [helm, "template", "rel", str(CHART), "--namespace", "slipstream-system"]
    for value in sets:
        argv += ["--set", value]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(documents: list[dict], kind: str) -> list[dict]:
    return [doc for doc in documents if doc["kind"] == kind]


def rule_for(policy: dict, port: int) -> dict:
    (rule,) = [rule for rule in policy["spec"]["ingress"]
               if any(p["port"] == port for p in rule.get("ports") or [])]
    return rule


def namespaces_of(rule: dict) -> set[str]:
    return {peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            for peer in rule.get("from") or [] if "namespaceSelector" in peer}


def test_agents_take_api_calls_from_routers_and_control_calls_from_the_operator():
    documents = render("networkPolicy.gatewayNamespace=gateway")
    policies = {p["metadata"]["name"]: p for p in of_kind(documents, "NetworkPolicy")}
    assert set(policies) == {"slipstream-agents", "slipstream-routers", "rel-slipstream-operator"}
    agents = policies["slipstream-agents"]
    assert agents["spec"]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "slipstream-agent"}
    assert agents["spec"]["policyTypes"] == ["Ingress"]
    api = rule_for(agents, 8000)
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "slipstream-router"}}} \
        in api["from"]
    assert namespaces_of(api) == {"gateway", "monitoring"}
    control = rule_for(agents, 50051)
    assert namespaces_of(control) == {"slipstream-system"}
    operator_peer = next(peer for peer in control["from"] if "namespaceSelector" in peer)
    assert operator_peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == \
        "slipstream-operator"
    assert len(control["from"]) == 2  # the operator and the routers, nobody else
    routers = policies["slipstream-routers"]
    assert namespaces_of(rule_for(routers, 8000)) == {"gateway", "monitoring"}
    operator = policies["rel-slipstream-operator"]
    assert namespaces_of(rule_for(operator, 8080)) == {"monitoring"}


def test_policies_go_to_every_watched_namespace_and_can_be_turned_off():
    documents = render("watchNamespaces={serving,batch}")
    agents = [p for p in of_kind(documents, "NetworkPolicy")
              if p["metadata"]["name"] == "slipstream-agents"]
    assert {p["metadata"]["namespace"] for p in agents} == {"serving", "batch"}
    assert not of_kind(render("networkPolicy.enabled=false"), "NetworkPolicy")


def test_the_operator_pod_is_hardened_and_holds_the_master_key():
    documents = render()
    (deployment,) = of_kind(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    command = container["command"]
    key_path = command[command.index("--control-master-key-file") + 1]
    (mount,) = container["volumeMounts"]
    assert key_path.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    (secret,) = of_kind(documents, "Secret")
    assert pod["volumes"][0]["secret"]["secretName"] == secret["metadata"]["name"]
    assert len(secret["data"]["master-key"]) >= 64  # base64 of 64 random characters


def test_the_operator_may_create_secrets_and_never_read_them():
    documents = render()
    rules = [rule for role in of_kind(documents, "ClusterRole") for rule in role["rules"]]
    secret_rules = [rule for rule in rules if "secrets" in rule["resources"]]
    assert [rule["verbs"] for rule in secret_rules] == [["create"]]
    open_plane = render("controlPlane.auth=false")
    assert not of_kind(open_plane, "Secret")
    rules = [rule for role in of_kind(open_plane, "ClusterRole") for rule in role["rules"]]
    assert not [rule for rule in rules if "secrets" in rule["resources"]]
    (deployment,) = of_kind(open_plane, "Deployment")
    assert "--control-master-key-file" not in \
        deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def test_an_existing_master_key_secret_is_used_as_given():
    documents = render("controlPlane.masterKeySecret=my-key")
    assert not of_kind(documents, "Secret")
    (deployment,) = of_kind(documents, "Deployment")
    assert deployment["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == \
        "my-key"
