"""A minimal Kubernetes API client over plain HTTPS (standard library only).

Used by the dev-cluster launcher and the test-harness kubelet, which must run before any
project package is installed. The control plane is local and uses a self-signed serving
certificate, so TLS verification is off, exactly as in the generated kubeconfig.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterator

JSON = dict[str, Any]


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, method: str, path: str, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class KubeApi:
    """Talks to one API server at `server` (https://127.0.0.1:port) with a bearer token."""

    server: str
    token: str
    timeout_s: float = 30.0

    def _connection(self, timeout_s: float | None) -> http.client.HTTPSConnection:
        parsed = urllib.parse.urlsplit(self.server)
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return http.client.HTTPSConnection(parsed.hostname, parsed.port or 443,
                                           timeout=timeout_s, context=context)

    def request(self, method: str, path: str, body: JSON | None = None,
                content_type: str = "application/json", query: dict | None = None,
                ok_missing: bool = False) -> JSON | None:
        """Send one request; return the decoded body, or None for a tolerated 404."""
        if query:
            path = f"{path}?{urllib.parse.urlencode(query)}"
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        connection = self._connection(self.timeout_s)
        try:
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            text = response.read().decode("utf-8", errors="replace")
        finally:
            connection.close()
        if response.status == 404 and ok_missing:
            return None
        if response.status >= 300:
            raise ApiError(response.status, method, path, text)
        return json.loads(text) if text else {}

    def get(self, path: str, query: dict | None = None, ok_missing: bool = False) -> JSON | None:
        return self.request("GET", path, query=query, ok_missing=ok_missing)

    def post(self, path: str, body: JSON) -> JSON:
        return self.request("POST", path, body)

    def put(self, path: str, body: JSON) -> JSON:
        return self.request("PUT", path, body)

    def patch(self, path: str, body: JSON, strategy: str = "strategic-merge") -> JSON:
        return self.request("PATCH", path, body, content_type=f"application/{strategy}-patch+json")

    def delete(self, path: str, body: JSON | None = None) -> JSON | None:
        return self.request("DELETE", path, body, ok_missing=True)

    def watch(self, path: str, resource_version: str, query: dict | None = None,
              timeout_s: int = 60) -> Iterator[JSON]:
        """Yield watch events until the server closes the stream (about `timeout_s`)."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "timeoutSeconds": str(timeout_s), "allowWatchBookmarks": "true", **(query or {})}
        full_path = f"{path}?{urllib.parse.urlencode(params)}"
        connection = self._connection(timeout_s + 15)
        try:
            connection.request("GET", full_path,
                               headers={"Authorization": f"Bearer {self.token}"})
            response = connection.getresponse()
            if response.status >= 300:
                raise ApiError(response.status, "WATCH", path, response.read().decode())
            while True:
                line = response.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            connection.close()
