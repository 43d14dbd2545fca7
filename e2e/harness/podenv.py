"""Turn a pod's first container into a process launch: argv, environment, working directory.

Part of the test-harness kubelet. Mirrors what kubelet does before it starts a container:
resolve `env` (plain values, the downward API, ConfigMap and Secret keys), `envFrom`, and
`$(VAR)` references in env values, command and args. ConfigMap volumes cannot be mounted
into a plain process: their keys are written as files under the pod's state dir, and
command-line paths under the volume's mountPath are pointed there.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path

from kubeapi import JSON, KubeApi

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class PodSpecError(Exception):
    """The pod cannot be started as a process (reported as the container's waiting reason)."""


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    working_dir: str | None


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, `$$` escapes, others stay."""
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))
    return _REFERENCE.sub(replace, text)


def field_value(pod: JSON, field_path: str, pod_ip: str) -> str:
    """The downward API's fieldRef paths that kubelet supports for env."""
    metadata, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": metadata.get("name", ""),
        "metadata.namespace": metadata.get("namespace", ""),
        "metadata.uid": metadata.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": "127.0.0.1",
        "status.hostIPs": "127.0.0.1",
    }
    if field_path in simple:
        return simple[field_path]
    subscript = _SUBSCRIPT.match(field_path)
    if subscript:
        return (metadata.get(subscript.group(1)) or {}).get(subscript.group(2), "")
    raise PodSpecError(f"unsupported fieldRef {field_path!r}")


def _object_data(api: KubeApi, namespace: str, kind: str, name: str, optional: bool) -> dict:
    resource = "configmaps" if kind == "ConfigMap" else "secrets"
    found = api.get(f"/api/v1/namespaces/{namespace}/{resource}/{name}", ok_missing=True)
    if found is None:
        if optional:
            return {}
        raise PodSpecError(f"{kind} {namespace}/{name} not found")
    data = dict(found.get("data") or {})
    if kind == "Secret":
        data = {key: base64.b64decode(value).decode() for key, value in data.items()}
    return data


def _key_ref(api: KubeApi, namespace: str, kind: str, ref: JSON) -> str | None:
    data = _object_data(api, namespace, kind, ref["name"], ref.get("optional", False))
    if ref["key"] not in data and not ref.get("optional", False):
        raise PodSpecError(f"key {ref['key']!r} not in {kind} {namespace}/{ref['name']}")
    return data.get(ref["key"])


def resolve_env(api: KubeApi, pod: JSON, container: JSON, pod_ip: str) -> dict[str, str]:
    """The container's environment, in kubelet's order: envFrom, then env (later wins)."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                ref = source[key]
                data = _object_data(api, namespace, kind, ref["name"], ref.get("optional", False))
                env.update({prefix + name: value for name, value in data.items()})
    for variable in container.get("env") or []:
        name = variable["name"]
        if "valueFrom" not in variable:
            env[name] = expand(variable.get("value", ""), env)
            continue
        source = variable["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "ConfigMap" if "configMapKeyRef" in source else "Secret"
            value = _key_ref(api, namespace, kind, source.get("configMapKeyRef")
                             or source["secretKeyRef"])
            if value is not None:
                env[name] = value
        elif "resourceFieldRef" in source:
            env[name] = resource_value(container, source["resourceFieldRef"])
        else:
            raise PodSpecError(f"unsupported valueFrom for {name}: {sorted(source)}")
    return env


def resource_value(container: JSON, ref: JSON) -> str:
    """limits.X / requests.X as written in the spec (no unit conversion beyond the divisor 1)."""
    section, _, resource = ref["resource"].partition(".")
    resources = (container.get("resources") or {}).get(section) or {}
    return str(resources.get(resource, "0"))


def project_config_maps(api: KubeApi, pod: JSON, container: JSON,
                        volume_dir: Path) -> dict[str, str]:
    """Write the container's ConfigMap and Secret volumes under
    ``volume_dir/<volume>/<key>``; returns {mountPath: that directory}."""
    sources: dict[str, tuple[str, str, bool]] = {}
    for volume in pod["spec"].get("volumes") or []:
        if "configMap" in volume:
            config_map = volume["configMap"]
            sources[volume["name"]] = ("ConfigMap", config_map["name"],
                                       config_map.get("optional", False))
        elif "secret" in volume:
            secret = volume["secret"]
            sources[volume["name"]] = ("Secret", secret["secretName"],
                                       secret.get("optional", False))
    mounts: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        source = sources.get(mount["name"])
        if source is None:
            continue
        kind, name, optional = source
        data = _object_data(api, pod["metadata"]["namespace"], kind, name, optional)
        directory = volume_dir / mount["name"]
        directory.mkdir(parents=True, exist_ok=True)
        for key, text in data.items():
            (directory / key).write_text(text)
        mounts[mount["mountPath"].rstrip("/")] = str(directory)
    return mounts


def point_into_mounts(part: str, mounts: dict[str, str]) -> str:
    """A command-line word naming a path under a mounted volume, pointed at its local copy."""
    for mount_path, directory in mounts.items():
        if part == mount_path or part.startswith(mount_path + "/"):
            return directory + part[len(mount_path):]
    return part


def build_launch(api: KubeApi, pod: JSON, pod_ip: str, base_env: dict[str, str],
                 runtime_env: dict[str, str], volume_dir: Path) -> Launch:
    """argv, env and cwd for the pod's first container.

    `base_env` is the harness's own environment (so PATH and PYTHONPATH reach the process);
    `runtime_env` is what the runtime adds (service-account KUBECONFIG); the pod's env wins.
    ConfigMap and Secret volumes are written under `volume_dir`.
    """
    containers = pod["spec"].get("containers") or []
    if not containers:
        raise PodSpecError("pod has no containers")
    container = containers[0]
    pod_env = resolve_env(api, pod, container, pod_ip)
    pod_env.setdefault("POD_IP", pod_ip)
    pod_env.setdefault("HOSTNAME", pod["metadata"]["name"])
    mounts = project_config_maps(api, pod, container, volume_dir)
    argv = [point_into_mounts(expand(part, pod_env), mounts)
            for part in (container.get("command") or []) + (container.get("args") or [])]
    if not argv:
        raise PodSpecError("container has no command: the process runtime has no image "
                           "entrypoint to fall back on")
    return Launch(argv=argv, env={**base_env, **runtime_env, **pod_env},
                  working_dir=container.get("workingDir"))
