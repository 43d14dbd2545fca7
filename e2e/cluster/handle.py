"""What e2e tests hold of a running dev cluster: its kubeconfig, API, kubectl and helm.

Built by the `dev_cluster` fixture (`e2e/conftest.py`) from the state that
`devcluster.start` returns. Tests drive the cluster through the real kubectl and helm
binaries, or through `api` for quick reads.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


def wait_for(check: Callable[[], Any], timeout_s: float, what: str,
             period_s: float = 0.25, describe: Callable[[], str] | None = None) -> Any:
    """Poll until `check()` returns something truthy and return it. On a timeout the error
    says what `describe()` (if given) returns: the state that explains why it never came."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            state = ""
            if describe is not None:
                try:
                    state = f"; {describe()}"
                except Exception as error:  # noqa: BLE001 - the timeout is the failure
                    state = f"; (describing the state failed: {error!r})"
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{state}")
        time.sleep(period_s)


@dataclass(frozen=True)
class DevCluster:
    kubeconfig: Path
    api_url: str
    token: str
    bin_dir: Path
    state_dir: Path
    nodes: tuple[str, ...]
    pod_network: ipaddress.IPv4Network  # where pod IPs come from
    api: Any = field(repr=False)  # kubeapi.KubeApi, loaded by path

    wait_for = staticmethod(wait_for)

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses that should talk to this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join([str(self.bin_dir), env.get("PATH", "")])
        # helm keeps caches and plugins per user; keep this cluster's apart.
        for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            env[name] = str(self.state_dir / "helm" / name.split("_")[1].lower())
        return env

    def _run(self, binary: str, args: tuple[str, ...], input_text: str | None, check: bool,
             timeout_s: float) -> subprocess.CompletedProcess:
        completed = subprocess.run([str(self.bin_dir / binary), *args], env=self.env,
                                   input=input_text, capture_output=True, text=True,
                                   timeout=timeout_s)
        if check and completed.returncode != 0:
            raise AssertionError(f"{binary} {' '.join(args)} failed ({completed.returncode}):\n"
                                 f"{completed.stdout}\n{completed.stderr}")
        return completed

    def kubectl(self, *args: str, input_text: str | None = None, check: bool = True,
                timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return self._run("kubectl", args, input_text, check, timeout_s)

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, manifest: dict | str) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        self.kubectl("apply", "-f", "-", input_text=text)

    def helm(self, *args: str, check: bool = True,
             timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        return self._run("helm", args, None, check, timeout_s)

    def create_namespace(self, name: str, timeout_s: float = 30.0) -> None:
        """Create a namespace and wait until pods are admissible in it (its default
        ServiceAccount, made by kube-controller-manager, exists)."""
        self.kubectl("create", "namespace", name)
        wait_for(lambda: self.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default",
                                      ok_missing=True) is not None,
                 timeout_s, f"default ServiceAccount in {name}")

    def pod_log(self, namespace: str, name: str) -> str:
        """What the harness kubelet captured from the pod's process (all restarts)."""
        path = self.state_dir / "logs" / f"{namespace}_{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

