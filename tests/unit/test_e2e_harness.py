"""Pure parts of the e2e control-plane tooling: build recipe, env expansion, probes, status."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[2] / "e2e"
sys.path.insert(0, str(E2E / "harness"))  # harness modules import each other by plain name


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


build = _load("slipstream_e2e_build_under_test", E2E / "cluster" / "build.py")
podenv = _load("podenv", E2E / "harness" / "podenv.py")
probes = _load("probes", E2E / "harness" / "probes.py")
podstatus = _load("podstatus", E2E / "harness" / "podstatus.py")
processes = _load("processes", E2E / "harness" / "processes.py")


def test_staging_modules_are_replaced_by_their_published_minor():
    go_mod = "require (\n\tk8s.io/api v0.0.0\n\tk8s.io/klog/v2 v2.140.0\n" \
             "\tk8s.io/client-go v0.0.0\n)\n"
    assert build.staging_replacements(go_mod, "1.37.1") == [
        "\tk8s.io/api => k8s.io/api v0.37.1",
        "\tk8s.io/client-go => k8s.io/client-go v0.37.1",
    ]
    with pytest.raises(RuntimeError):
        build.staging_replacements("require k8s.io/klog/v2 v2.1.0\n", "1.37.1")


def test_ldflags_set_the_release_version_for_both_version_packages():
    flags = build.kubernetes_ldflags("1.37.1", "2026-09-23T17:06:22Z")
    assert "-X k8s.io/component-base/version.gitVersion=v1.37.1" in flags
    assert "-X k8s.io/client-go/pkg/version.gitMinor=37" in flags


def test_dollar_references_expand_like_kubelet():
    env = {"POD_IP": "127.9.1.1", "PORT": "80"}
    assert podenv.expand("$(POD_IP):$(PORT)", env) == "127.9.1.1:80"
    assert podenv.expand("$(MISSING) $$(POD_IP)", env) == "$(MISSING) $(POD_IP)"


def test_field_refs_cover_labels_and_pod_ip():
    pod = {"metadata": {"name": "p", "namespace": "n", "labels": {"role": "prefill"}},
           "spec": {"nodeName": "gpu-node-0"}}
    assert podenv.field_value(pod, "metadata.labels['role']", "127.0.0.2") == "prefill"
    assert podenv.field_value(pod, "status.podIP", "127.0.0.2") == "127.0.0.2"
    with pytest.raises(podenv.PodSpecError):
        podenv.field_value(pod, "spec.unknown", "127.0.0.2")


def test_probe_tracker_needs_failure_threshold_to_turn_unready():
    tracker = probes.ProbeTracker({"periodSeconds": 1, "failureThreshold": 2,
                                   "initialDelaySeconds": 5}, started_at_s=100.0)
    assert not tracker.due(104.0) and tracker.due(105.0)
    tracker.record(True, 105.0)
    assert tracker.passing and not tracker.due(105.5)
    tracker.record(False, 106.0)
    assert tracker.passing
    tracker.record(False, 107.0)
    assert not tracker.passing and tracker.failed_out


def test_status_moves_from_pending_to_running_to_failed():
    run = podstatus.ContainerRun("main", "img", "127.9.0.1", created_at_s=1.0)
    assert podstatus.build_pod_status(run, 1.0)["phase"] == "Pending"
    run.pid, run.running_since_s, run.ready = 42, 2.0, True
    running = podstatus.build_pod_status(run, 2.0)
    ready = next(c for c in running["conditions"] if c["type"] == "Ready")
    assert running["phase"] == "Running" and ready["status"] == "True"
    run.pid, run.running_since_s, run.ready = None, None, False
    run.last_termination = podstatus.termination_record(-9, 2.0, 3.0, 42)
    run.finished_phase = "Failed"
    failed = podstatus.build_pod_status(run, 3.0)
    assert failed["phase"] == "Failed"
    assert failed["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137


def test_kill_process_group_takes_the_children_too():
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    time.sleep(0.2)
    start_time = processes.process_start_time(leader.pid)
    assert processes.is_same_process(leader.pid, start_time)
    assert not processes.is_same_process(leader.pid, start_time + 1)
    processes.kill_process_group(leader.pid, 2.0, leader)
    assert leader.returncode is not None
    assert processes.live_group_members(leader.pid) == []


def test_config_map_volumes_become_local_files_the_command_points_at(tmp_path):
    class Api:  # the harness's KubeApi, answering one GET
        def get(self, path, ok_missing=False):
            assert path == "/api/v1/namespaces/ns/configmaps/chat-engine"
            return {"data": {"engine.yaml": "model: {name: m, path: /m}\n"}}

    pod = {"metadata": {"name": "p", "namespace": "ns"},
           "spec": {"volumes": [{"name": "cfg", "configMap": {"name": "chat-engine"}},
                                {"name": "model", "hostPath": {"path": "/m"}}],
                    "containers": [{"command": ["serve", "--config", "/etc/s/engine.yaml",
                                                "--port", "$(PORT)"],
                                    "env": [{"name": "PORT", "value": "80"}],
                                    "volumeMounts": [{"name": "cfg", "mountPath": "/etc/s"},
                                                     {"name": "model", "mountPath": "/m"}]}]}}
    launch = podenv.build_launch(Api(), pod, "127.0.0.2", {}, {}, tmp_path / "volumes")
    config = tmp_path / "volumes" / "cfg" / "engine.yaml"
    assert launch.argv == ["serve", "--config", str(config), "--port", "80"]
    assert config.read_text() == "model: {name: m, path: /m}\n"
