"""Pool membership from Kubernetes: the agent pods themselves, listed and then watched.

    API server --list, then watch pods (label selector)--> PodWatcher thread
        --call_soon_threadsafe(apply_pod_event)--> InstanceTable (event loop)

The operator moves an instance between pools by relabelling its pods
(``slipstream.dev/pool``); the watch delivers that as one MODIFIED event and the next request
is routed by the new label, with no restart. Backends come from each pod's ``status.podIP``
and its container port named ``http``, not from EndpointSlices: that works the same on a
real cluster and on the local test control plane, whose loopback pod IPs EndpointSlices
reject. Only Ready pods that are not being deleted receive traffic.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from slipstream.agent.router.config import INSTANCE_LABEL, POOL_LABEL, UNIFIED_POOL, \
    KubernetesDiscovery
from slipstream.agent.router.instances import BackendSpec, InstanceTable

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 30  # a watch is renewed this often, so stop() takes effect within it
RETRY_DELAY_S = 2.0


def backend_from_pod(pod: dict[str, Any], discovery: KubernetesDiscovery) -> BackendSpec | None:
    """The backend a pod offers, or None when it should get no traffic now."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or not status.get("podIP") or not _is_ready(status):
        return None
    labels = metadata.get("labels") or {}
    ip = status["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    name = metadata.get("name", ip)
    return BackendSpec(name=name, url=f"http://{host}:{_http_port(pod, discovery)}",
                       pool=labels.get(POOL_LABEL, UNIFIED_POOL),
                       instance=labels.get(INSTANCE_LABEL, name))


def apply_pod_event(table: InstanceTable, event_type: str, pod: dict[str, Any],
                    discovery: KubernetesDiscovery) -> None:
    """One watch event (ADDED, MODIFIED, DELETED) applied to the table."""
    name = (pod.get("metadata") or {}).get("name")
    if not name:
        return
    spec = None if event_type == "DELETED" else backend_from_pod(pod, discovery)
    if spec is None:
        table.remove(name)
    else:
        table.upsert(spec)


def _is_ready(status: dict[str, Any]) -> bool:
    return any(condition.get("type") == "Ready" and condition.get("status") == "True"
               for condition in status.get("conditions") or [])


def _http_port(pod: dict[str, Any], discovery: KubernetesDiscovery) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == discovery.port_name and port.get("containerPort"):
                return int(port["containerPort"])
    return discovery.default_port


class PodWatcher:
    """List, then watch, the agent pods in a daemon thread; relist when the watch breaks."""

    def __init__(self, discovery: KubernetesDiscovery, table: InstanceTable,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.discovery = discovery
        self._table = table
        self._loop = loop
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self._api: Any = None  # kubernetes.client.CoreV1Api (untyped) once started

    def start(self) -> None:
        from kubernetes import client, config

        if self.discovery.kubeconfig is not None:
            config.load_kube_config(config_file=self.discovery.kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()  # $KUBECONFIG or ~/.kube/config
        self._api = client.CoreV1Api()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self._list_and_watch()
            except Exception as error:  # API server away, token rotated...: relist soon
                log.warning("pod watch failed, relisting in %.0f s: %s", RETRY_DELAY_S, error)
                self._stopped.wait(RETRY_DELAY_S)

    def _list_and_watch(self) -> None:
        import json

        from kubernetes import watch

        namespace, selector = self.discovery.namespace, self.discovery.label_selector
        response = self._api.list_namespaced_pod(namespace, label_selector=selector,
                                                 _preload_content=False)
        pod_list = json.loads(response.data)
        specs = [spec for pod in pod_list.get("items", [])
                 if (spec := backend_from_pod(pod, self.discovery)) is not None]
        self._loop.call_soon_threadsafe(self._table.replace_all, specs)
        version = pod_list["metadata"]["resourceVersion"]
        while not self._stopped.is_set():
            stream = watch.Watch().stream(
                self._api.list_namespaced_pod, namespace, label_selector=selector,
                resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                allow_watch_bookmarks=True)
            for event in stream:
                if self._stopped.is_set():
                    return
                raw = event.get("raw_object") or {}
                if event["type"] == "ERROR":  # e.g. 410 Gone: our version is too old
                    raise RuntimeError(f"watch error: {raw.get('message', raw)}")
                version = (raw.get("metadata") or {}).get("resourceVersion", version)
                if event["type"] != "BOOKMARK":
                    self._loop.call_soon_threadsafe(apply_pod_event, self._table,
                                                    event["type"], raw, self.discovery)
