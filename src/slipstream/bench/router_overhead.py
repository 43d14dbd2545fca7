"""What the router adds to a request: TTFT and end-to-end latency, direct vs through it.

Starts one ``slipstream serve`` (the embedded tiny model, CPU) and one ``slipstream router``
in front of it, as real processes on loopback, then sends the same sequential streaming chat
requests to each, alternating, so drift on a shared machine hits both alike. Reports medians
and p90s in ms and writes ``router_overhead.json``::

    python -m slipstream.bench.router_overhead --out results/router --requests 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from typing import Any
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from slipstream.agent.parallel.launch import free_port


@contextlib.contextmanager
def _process(args: list[str], health_url: str, log_path: Path) -> Iterator[None]:
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "slipstream.cli", *args],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(log_path.read_text())
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy: {log_path.read_text()}")
            time.sleep(0.2)
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)


def _one_request(client: httpx.Client, base_url: str, index: int,
                 max_tokens: int) -> tuple[float, float]:
    body = {"messages": [{"role": "user", "content": f"request {index}: say something"}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    ttft = None
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if ttft is None and '"content":"' in line and '"content":""' not in line:
                ttft = time.perf_counter() - started
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - started


def _summary(samples_s: list[float]) -> dict[str, float]:
    values = np.array(samples_s) * 1000.0
    return {"median_ms": float(np.nanmedian(values)), "p90_ms": float(np.nanpercentile(values, 90))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/router"))
    parser.add_argument("--requests", type=int, default=200, help="per path (direct, router)")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    agent_port, router_port = free_port(), free_port()
    agent_url, router_url = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{router_port}"
    samples: dict[str, dict[str, list[float]]] = {
        path: {"ttft": [], "e2e": []} for path in ("direct", "router")}
    with _process(["serve", "--port", str(agent_port), "--device", "cpu", "--log-level",
                   "warning", "--no-profile"], f"{agent_url}/health", args.out / "serve.log"), \
            _process(["router", "--port", str(router_port), "--backend", f"{agent_url}=short",
                      "--log-level", "warning"], f"{router_url}/health",
                     args.out / "router.log"), httpx.Client(timeout=60) as client:
        for index in range(5):  # warm-up: first-request costs on both paths
            _one_request(client, agent_url, index, args.max_tokens)
            _one_request(client, router_url, index, args.max_tokens)
        for index in range(args.requests):
            for path, url in (("direct", agent_url), ("router", router_url)):
                ttft_s, e2e_s = _one_request(client, url, index, args.max_tokens)
                samples[path]["ttft"].append(ttft_s)
                samples[path]["e2e"].append(e2e_s)
    result: dict[str, Any] = {path: {metric: _summary(values) for metric, values in metrics.items()}
                              for path, metrics in samples.items()}
    result["added_ttft_median_ms"] = (result["router"]["ttft"]["median_ms"]
                                      - result["direct"]["ttft"]["median_ms"])
    result["config"] = {"requests": args.requests, "max_tokens": args.max_tokens}
    (args.out / "router_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
