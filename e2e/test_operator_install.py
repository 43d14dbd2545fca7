"""(1) The chart installs, and the operator runs under the chart's ServiceAccount with only the
rights the chart grants."""

from __future__ import annotations

import json

import pytest

from operator_env import operator_kubeconfig, operator_pods

pytestmark = pytest.mark.e2e


def as_operator(dev_cluster, kubeconfig, *args: str):
    return dev_cluster.kubectl("--kubeconfig", str(kubeconfig), *args, check=False)


def test_helm_release_deploys_the_operator(dev_cluster, operator_release):
    releases = json.loads(dev_cluster.helm("list", "-n", operator_release.namespace,
                                           "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("slipstream", "deployed")]
    crds = dev_cluster.kubectl_json("get", "crd", "servingreplicas.slipstream.dev")
    assert crds["spec"]["versions"][0]["subresources"]["scale"]
    deployment = dev_cluster.kubectl_json("get", "deployment", operator_release.deployment,
                                          "-n", operator_release.namespace)
    assert deployment["status"].get("readyReplicas") == 1
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == operator_release.service_account


def test_operator_process_authenticates_as_the_chart_service_account(dev_cluster,
                                                                      operator_release):
    kubeconfig = operator_kubeconfig(dev_cluster, operator_release)
    review = json.loads(as_operator(dev_cluster, kubeconfig, "auth", "whoami", "-o",
                                    "json").stdout)
    assert review["status"]["userInfo"]["username"] == (
        f"system:serviceaccount:{operator_release.namespace}:"
        f"{operator_release.service_account}")


@pytest.mark.parametrize("denied", [
    ("get", "secrets", "-A"),
    # The router's grant is a RoleBinding of a fixed ClusterRole: no Roles of its own making.
    ("create", "role", "x", "--verb=get", "--resource=secrets", "-n", "default"),
    ("create", "clusterrole", "x", "--verb=get", "--resource=pods"),
    ("delete", "node", "gpu-node-0"),
    ("create", "clusterrolebinding", "x", "--clusterrole=cluster-admin", "--user=x"),
    ("create", "namespace", "not-allowed"),
    ("delete", "customresourcedefinition", "servingreplicas.slipstream.dev"),
], ids=lambda args: " ".join(args[:2]))
def test_rbac_denies_what_the_chart_did_not_grant(dev_cluster, operator_release, denied):
    kubeconfig = operator_kubeconfig(dev_cluster, operator_release)
    result = as_operator(dev_cluster, kubeconfig, *denied)
    assert result.returncode != 0
    assert "forbidden" in result.stderr.lower(), result.stderr


def test_rbac_allows_what_the_operator_needs(dev_cluster, operator_release):
    kubeconfig = operator_kubeconfig(dev_cluster, operator_release)
    for verb, resource in [("list", "nodes"), ("create", "pods"), ("delete", "pods"),
                           ("patch", "servingreplicas.slipstream.dev/status"),
                           ("create", "events"), ("create", "deployments.apps"),
                           ("create", "serviceaccounts"),
                           ("create", "rolebindings.rbac.authorization.k8s.io")]:
        answer = as_operator(dev_cluster, kubeconfig, "auth", "can-i", verb, resource,
                             "-n", "default")
        assert answer.stdout.strip() == "yes", (verb, resource, answer.stderr)


def test_operator_exports_the_declared_metrics(dev_cluster, operator_release):
    """Every operator metric the dashboards and alerts may query (metric_names) is exported
    with its declared type and labels."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    from slipstream.contracts import metric_names

    ip = operator_pods(dev_cluster, operator_release, ready=True)[0]["status"]["podIP"]
    text = urlopen(f"http://{ip}:8080/metrics", timeout=10).read().decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for spec in metric_names.OPERATOR_METRICS:
        family = families.get(spec.constructor_name)
        assert family is not None, f"{spec.name} is not exported"
        assert family.type == spec.type, spec.name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(spec.labels), (spec.name, sample.labels)
