"""The kubelet endpoint behind `kubectl logs`, serving the harness's per-pod log files.

Part of the test-harness kubelet. kube-apiserver proxies `kubectl logs` to
`https://<node address>:<daemonEndpoints.kubeletEndpoint.Port>/containerLogs/<ns>/<pod>/<c>`;
with no --kubelet-certificate-authority it does not verify the serving certificate, so a
self-signed one made with openssl is enough. Only this one path is served.
"""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

FOLLOW_POLL_S = 0.25


def make_serving_certificate(directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    if not cert.exists():
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                        "-subj", "/CN=localhost", "-days", "365",
                        "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
    return cert, key


def tail_lines(data: bytes, count: int) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-count:]) if count >= 0 else data


def start_log_server(logs_dir: Path, cert_dir: Path,
                     pod_running: Callable[[str, str], bool]) -> int:
    """Serve in a daemon thread on a free loopback port; return the port."""
    cert, key = make_serving_certificate(cert_dir)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_args) -> None:  # request lines would flood the harness log
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            if len(parts) != 4 or parts[0] != "containerLogs":
                self.send_error(404, "only /containerLogs/<namespace>/<pod>/<container>")
                return
            _, namespace, pod, _container = parts
            query = urllib.parse.parse_qs(url.query)
            path = logs_dir / f"{namespace}_{pod}.log"
            if not path.exists():
                self.send_error(404, f"no log for {namespace}/{pod}")
                return
            data = path.read_bytes()
            if "tailLines" in query:
                data = tail_lines(data, int(query["tailLines"][0]))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(data)
            if query.get("follow", ["false"])[0] == "true":
                self.follow(path, path.stat().st_size, namespace, pod)

        def follow(self, path: Path, offset: int, namespace: str, pod: str) -> None:
            try:
                while pod_running(namespace, pod):
                    with open(path, "rb") as log_file:
                        log_file.seek(offset)
                        chunk = log_file.read()
                    if chunk:
                        offset += len(chunk)
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    time.sleep(FOLLOW_POLL_S)
            except (BrokenPipeError, ConnectionResetError):
                pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]
