"""(3) The API server rejects invalid specs with messages that name the field (the CRD's CEL
rules). (4) A topology that cannot fit creates no pods and says why, in a condition and an
Event (and the operator stops retrying the change: kopf.PermanentError)."""

from __future__ import annotations

import copy
import json

import pytest

from operator_env import condition, events, get_replica, replica_pods, servingreplica

pytestmark = pytest.mark.e2e

INVALID = [
    # (spec change, the field the error must name)
    ({"parallelism": {"tp": 3}}, "spec.parallelism.tp"),
    ({"parallelism": {"tp": 8, "spp": 6}}, "spec.parallelism.spp"),
    ({"parallelism": {"tp": 16}}, "spec.placement.gpusPerNode"),
    ({"parallelism": {"tp": 8, "kvpTokensPerGroup": 1000}},
     "spec.parallelism.kvpTokensPerGroup"),
    ({"model": {"name": "m", "source": {}}}, "spec.model.source"),
    ({"model": {"name": "m", "source": {"hostPath": {"path": "/m"},
                                        "pvc": {"claimName": "c"}}}}, "spec.model.source"),
    ({"instances": 2, "pools": {"short": 3}}, "spec.pools.short"),
    ({"instances": 2, "pools": {"short": 2}}, "minPerPool"),
    ({"scheduler": {"policy": "round-robin"}}, "spec.scheduler.policy"),
    ({"slo": {"ttftSeconds": 0}}, "spec.slo.ttftSeconds"),
    ({"slo": {"tpotMilliseconds": -1}}, "spec.slo.tpotMilliseconds"),
    ({"scheduler": {"maxSpaceShareFraction": 2}}, "spec.scheduler.maxSpaceShareFraction"),
    ({"instances": -1}, "spec.instances"),
    # Prefill/decode disaggregation.
    ({"disaggregation": {"prefill": {"instances": 0}, "decode": {"instances": 1}}},
     "spec.disaggregation.prefill.instances"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1},
                         "transport": "nfs"}}, "spec.disaggregation.transport"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
      "autoscaling": {"maxInstances": 4}}, "spec.autoscaling"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
      "parallelism": {"tp": 2}}, "spec.disaggregation"),
    ({"disaggregation": {"prefill": {"instances": 1}, "decode": {"instances": 3}},
      "instances": 4, "pools": {"short": 2}}, "spec.disaggregation.prefill.instances"),
]


@pytest.mark.parametrize(("change", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_spec_is_rejected_naming_the_field(dev_cluster, operator_release, change,
                                                   field, tiny_model_dir):
    manifest = servingreplica("bad", "default", tiny_model_dir)
    spec = copy.deepcopy(manifest["spec"])
    spec.update(change)
    manifest["spec"] = spec
    result = dev_cluster.kubectl("apply", "--dry-run=server", "-f", "-",
                                 input_text=json.dumps(manifest), check=False)
    assert result.returncode != 0, f"accepted: {change}"
    assert "is invalid" in result.stderr
    assert field in result.stderr, result.stderr


def test_topology_that_cannot_fit_creates_nothing_and_says_why(dev_cluster, sr_namespace,
                                                               tiny_model_dir):
    namespace = sr_namespace
    # tp=16 is valid against gpusPerNode 16, but the nodes have 8 GPUs each.
    dev_cluster.apply(servingreplica("huge", namespace, tiny_model_dir, instances=1, tp=16,
                                     placement={"gpusPerNode": 16}))
    placed = dev_cluster.wait_for(
        lambda: (r := get_replica(dev_cluster, namespace, "huge")) and condition(r, "Placed"),
        60, "a Placed condition")
    assert placed["status"] == "False" and placed["reason"] == "InsufficientGPUs"
    assert "TP group cannot span nodes" in placed["message"]
    assert "gpu-node-0: 8 free" in placed["message"]
    # No amount of waiting helps (kopf.PermanentError): the nodes hold 8 GPUs each.
    assert "even with every one of their GPUs free" in placed["message"]
    warning = dev_cluster.wait_for(lambda: events(dev_cluster, namespace, "InsufficientGPUs"),
                                   30, "an InsufficientGPUs Event")
    assert warning[0]["type"] == "Warning"
    assert warning[0]["involvedObject"]["name"] == "huge"
    replica = get_replica(dev_cluster, namespace, "huge")
    assert replica["status"]["phase"] == "Pending"
    assert replica_pods(dev_cluster, namespace, "huge", live=False) == []
    # A node selector nobody matches is reported as such.
    dev_cluster.apply(servingreplica("nowhere", namespace, tiny_model_dir, instances=1, tp=8,
                                     placement={"nodeSelector": {"gpu": "b200"}}))
    nowhere = dev_cluster.wait_for(
        lambda: (r := get_replica(dev_cluster, namespace, "nowhere")) and
        condition(r, "Placed"), 60, "a Placed condition")
    assert nowhere["reason"] == "NoEligibleNodes" and "gpu=b200" in nowhere["message"]
    assert replica_pods(dev_cluster, namespace, "nowhere", live=False) == []
