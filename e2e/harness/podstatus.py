"""What the harness kubelet reports as a pod's status, from its process's state.

Part of the test-harness kubelet: `ContainerRun` is the runtime state of a pod's one process,
`build_pod_status` turns it into the `status` that kubelet would write (phase, pod IP,
conditions, containerStatuses). Pure: no API calls, no processes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from kubeapi import JSON

HOST_IP = "127.0.0.1"


def rfc3339(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRun:
    """Where one pod's process stands; the kubelet loop mutates it, this module reads it."""

    container_name: str
    image: str
    pod_ip: str
    created_at_s: float
    restart_count: int = 0
    pid: int | None = None
    running_since_s: float | None = None
    waiting_reason: str | None = "ContainerCreating"
    waiting_message: str = ""
    last_termination: JSON | None = None
    finished_phase: str | None = None  # "Succeeded" or "Failed" once it will not restart
    ready: bool = False
    condition_times: dict[str, tuple[str, str]] = field(default_factory=dict)

    def condition(self, kind: str, value: bool, now_s: float) -> JSON:
        """A pod condition whose lastTransitionTime moves only when its value changes."""
        status = "True" if value else "False"
        previous = self.condition_times.get(kind)
        if previous is None or previous[0] != status:
            self.condition_times[kind] = (status, rfc3339(now_s))
        return {"type": kind, "status": status,
                "lastTransitionTime": self.condition_times[kind][1], "lastProbeTime": None}


def termination_record(exit_code: int, started_s: float, finished_s: float, pid: int) -> JSON:
    """A containerStatus `terminated` block; negative exit codes are deaths by signal."""
    code = exit_code if exit_code >= 0 else 128 - exit_code
    return {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": rfc3339(started_s),
        "finishedAt": rfc3339(finished_s),
        "containerID": f"process://{pid}",
    }


def container_state(run: ContainerRun) -> JSON:
    if run.pid is not None and run.running_since_s is not None:
        return {"running": {"startedAt": rfc3339(run.running_since_s)}}
    if run.finished_phase is not None and run.last_termination is not None:
        return {"terminated": run.last_termination}
    waiting: JSON = {"reason": run.waiting_reason or "ContainerCreating"}
    if run.waiting_message:
        waiting["message"] = run.waiting_message
    return {"waiting": waiting}


def pod_phase(run: ContainerRun) -> str:
    if run.finished_phase is not None:
        return run.finished_phase
    # A container in restart back-off still counts as Running, as kubelet reports it.
    if run.pid is not None or run.last_termination is not None:
        return "Running"
    return "Pending"


def build_pod_status(run: ContainerRun, now_s: float) -> JSON:
    running = run.pid is not None
    ready = running and run.ready
    status_of_container: JSON = {
        "name": run.container_name,
        "image": run.image,
        "imageID": "",
        "ready": ready,
        "started": running,
        "restartCount": run.restart_count,
        "state": container_state(run),
    }
    if running:
        status_of_container["containerID"] = f"process://{run.pid}"
    if run.last_termination is not None and run.finished_phase is None:
        status_of_container["lastState"] = {"terminated": run.last_termination}
    return {
        "phase": pod_phase(run),
        "hostIP": HOST_IP,
        "hostIPs": [{"ip": HOST_IP}],
        "podIP": run.pod_ip,
        "podIPs": [{"ip": run.pod_ip}],
        "startTime": rfc3339(run.created_at_s),
        "conditions": [
            run.condition("PodReadyToStartContainers", True, now_s),
            run.condition("Initialized", True, now_s),
            run.condition("ContainersReady", ready, now_s),
            run.condition("Ready", ready, now_s),
            run.condition("PodScheduled", True, now_s),
        ],
        "containerStatuses": [status_of_container],
    }
