"""Readiness and liveness probes for harness-run pods (httpGet, tcpSocket, exec).

Part of the test-harness kubelet. A `ProbeTracker` applies kubelet's timing rules
(initialDelaySeconds, periodSeconds, timeoutSeconds, success/failure thresholds) to one
probe of one running process; the kubelet loop asks it `due(now)` and feeds results back.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
from dataclasses import dataclass, field

from kubeapi import JSON


def _port(value: int | str, container: JSON) -> int:
    """Probe ports may be numbers or names of the container's ports."""
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or []:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"no container port named {value!r}")


def run_probe(probe: JSON, container: JSON, pod_ip: str, env: dict[str, str],
              cwd: str) -> bool:
    """One probe attempt; True when it succeeds within its timeout. Exec probes run in the
    pod's working directory, the nearest thing to running inside its container."""
    timeout_s = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            action = probe["httpGet"]
            connection_class = (http.client.HTTPSConnection
                                if action.get("scheme", "HTTP").upper() == "HTTPS"
                                else http.client.HTTPConnection)
            connection = connection_class(action.get("host") or pod_ip,
                                          _port(action["port"], container), timeout=timeout_s)
            try:
                headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
                connection.request("GET", action.get("path", "/"), headers=headers)
                return 200 <= connection.getresponse().status < 400
            finally:
                connection.close()
        if "tcpSocket" in probe:
            action = probe["tcpSocket"]
            address = (action.get("host") or pod_ip, _port(action["port"], container))
            with socket.create_connection(address, timeout=timeout_s):
                return True
        if "exec" in probe:
            completed = subprocess.run(probe["exec"]["command"], env=env, cwd=cwd,
                                       timeout=timeout_s,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return completed.returncode == 0
    except (OSError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException):
        return False
    return False  # grpc and unknown handlers never pass


@dataclass
class ProbeTracker:
    """Thresholded state of one probe over one container run."""

    probe: JSON
    started_at_s: float
    passing: bool = False
    consecutive_successes: int = 0
    consecutive_failures: int = 0
    next_due_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.next_due_s = self.started_at_s + float(self.probe.get("initialDelaySeconds", 0))

    def due(self, now_s: float) -> bool:
        return now_s >= self.next_due_s

    def record(self, succeeded: bool, now_s: float) -> None:
        self.next_due_s = now_s + float(self.probe.get("periodSeconds", 10))
        if succeeded:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            if self.consecutive_successes >= int(self.probe.get("successThreshold", 1)):
                self.passing = True
        else:
            self.consecutive_failures += 1
            self.consecutive_successes = 0
            if self.consecutive_failures >= int(self.probe.get("failureThreshold", 3)):
                self.passing = False

    @property
    def failed_out(self) -> bool:
        """For liveness: the failure threshold has been reached."""
        return self.consecutive_failures >= int(self.probe.get("failureThreshold", 3))
