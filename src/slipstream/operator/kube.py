"""The few Kubernetes API calls the operator makes, over the official client, as plain dicts.

    handle_*.py --Kube--> kubernetes.client (CoreV1Api, CustomObjectsApi) --> kube-apiserver

Handlers and builders work with dicts (the wire form), so responses are decoded straight from
JSON instead of the client's model classes. Every write is idempotent: creating what exists
or deleting what is gone is not an error, because reconcile may run again at any time (after
an operator restart, or a retry) and must converge rather than fail.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from slipstream.crds.servingreplica import GROUP, PLURAL, VERSION

HTTP_NOT_FOUND, HTTP_CONFLICT = 404, 409
# The generated client defaults PATCH to JSON Patch; every patch here is a merge patch.
MERGE_PATCH = "application/merge-patch+json"


def load_client_config() -> None:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def _json(response: Any) -> Any:
    return json.loads(response.data)


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        # The client has no type information; its methods are called with plain dicts.
        self.core: Any = client.CoreV1Api(api_client)
        self.custom: Any = client.CustomObjectsApi(api_client)
        self.apps: Any = client.AppsV1Api(api_client)
        self.rbac: Any = client.RbacAuthorizationV1Api(api_client)

    # -- reads ------------------------------------------------------------------------------

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        return _json(self.core.list_namespaced_pod(
            namespace, label_selector=label_selector, _preload_content=False))["items"]

    def list_active_pods_everywhere(self) -> list[dict]:
        """Non-terminal pods in every namespace: what holds GPUs on the nodes."""
        return _json(self.core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed",
            _preload_content=False))["items"]

    def list_nodes(self) -> list[dict]:
        return _json(self.core.list_node(_preload_content=False))["items"]

    def get_replica(self, namespace: str, name: str) -> dict | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False))
        except ApiException as error:
            if error.status == HTTP_NOT_FOUND:
                return None
            raise

    # -- writes -----------------------------------------------------------------------------

    def patch_replica_status(self, namespace: str, name: str, status: dict) -> None:
        """JSON merge patch of the status subresource (None values remove fields)."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status},
            _content_type=MERGE_PATCH, _preload_content=False)

    def create(self, manifest: dict) -> bool:
        """Create; False when it already exists."""
        namespace = manifest["metadata"]["namespace"]
        create = {"Pod": self.core.create_namespaced_pod,
                  "Service": self.core.create_namespaced_service,
                  "ConfigMap": self.core.create_namespaced_config_map,
                  "Secret": self.core.create_namespaced_secret,
                  "ServiceAccount": self.core.create_namespaced_service_account,
                  "RoleBinding": self.rbac.create_namespaced_role_binding,
                  "Deployment": self.apps.create_namespaced_deployment}[manifest["kind"]]
        try:
            create(namespace, manifest, _preload_content=False)
        except ApiException as error:
            if error.status == HTTP_CONFLICT:
                return False
            raise
        return True

    def ensure(self, manifest: dict) -> None:
        """Create, or bring an existing child (anything but a Pod) in line with
        ``manifest``. Read first: a Service create that conflicts still costs the API server
        a ClusterIP allocation and release, and most reconciles find everything in place."""
        metadata, kind = manifest["metadata"], manifest["kind"]
        read = {"ConfigMap": self.core.read_namespaced_config_map,
                "Service": self.core.read_namespaced_service,
                "ServiceAccount": self.core.read_namespaced_service_account,
                "RoleBinding": self.rbac.read_namespaced_role_binding,
                "Deployment": self.apps.read_namespaced_deployment}[kind]
        try:
            current = _json(read(metadata["name"], metadata["namespace"],
                                 _preload_content=False))
        except ApiException as error:
            if error.status != HTTP_NOT_FOUND:
                raise
            self.create(manifest)
            return
        wanted = _owned_fields(manifest, current)
        if _contains(current, wanted):
            return
        patch = {"ConfigMap": self.core.patch_namespaced_config_map,
                 "Service": self.core.patch_namespaced_service,
                 "ServiceAccount": self.core.patch_namespaced_service_account,
                 "RoleBinding": self.rbac.patch_namespaced_role_binding,
                 "Deployment": self.apps.patch_namespaced_deployment}[kind]
        patch(metadata["name"], metadata["namespace"], wanted, _content_type=MERGE_PATCH,
              _preload_content=False)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        delete = {"Pod": self.core.delete_namespaced_pod,
                  "Service": self.core.delete_namespaced_service,
                  "ConfigMap": self.core.delete_namespaced_config_map,
                  "ServiceAccount": self.core.delete_namespaced_service_account,
                  "RoleBinding": self.rbac.delete_namespaced_role_binding,
                  "Deployment": self.apps.delete_namespaced_deployment}[kind]
        try:
            delete(name, namespace, propagation_policy="Background", _preload_content=False)
        except ApiException as error:
            if error.status != HTTP_NOT_FOUND:
                raise

    def patch_pod_labels(self, namespace: str, name: str, labels: dict[str, str],
                         annotations: dict[str, str] | None = None) -> None:
        metadata: dict = {"labels": labels}
        if annotations:
            metadata["annotations"] = annotations
        self.core.patch_namespaced_pod(name, namespace, {"metadata": metadata},
                                       _content_type=MERGE_PATCH, _preload_content=False)


def _owned_fields(manifest: dict, current: dict) -> dict:
    """What the operator sets on a child: labels, and the data, the selector and ports, the
    subjects, or the Deployment's spec. Fields others add (annotations, a Service's clusterIP,
    defaults) are not its business. A Service selector is replaced, not merged: the client
    Service switches between agents and router pods, and a merge patch would keep stale keys
    (a null value removes one)."""
    fields: dict = {"metadata": {"labels": manifest["metadata"].get("labels") or {}}}
    kind = manifest["kind"]
    if kind == "ConfigMap":
        fields["data"] = manifest["data"]
    elif kind == "Service":
        selector = dict(manifest["spec"]["selector"])
        stale = set((current.get("spec") or {}).get("selector") or {}) - set(selector)
        fields["spec"] = {"selector": {**selector, **dict.fromkeys(stale)},
                          "ports": manifest["spec"]["ports"]}
    elif kind == "RoleBinding":
        fields["subjects"] = manifest["subjects"]  # roleRef is immutable
    elif kind == "Deployment":
        fields["spec"] = manifest["spec"]
    return fields


def _contains(actual: object, wanted: object) -> bool:
    """Does ``actual`` hold everything in ``wanted``? (Lists match item by item; the API
    server adds defaults such as a port's protocol, which must not count as drift.)"""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(_contains(actual.get(key), value)
                                                for key, value in wanted.items())
    if isinstance(wanted, list):
        return isinstance(actual, list) and len(actual) == len(wanted) and all(
            _contains(a, w) for a, w in zip(actual, wanted))
    return actual == wanted
