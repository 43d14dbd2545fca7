"""A real ``slipstream serve`` process on a free port, serving a tiny model made for the
session. Tests talk to it over HTTP only, with the official ``openai`` client or httpx."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.bench import local_process
from slipstream.agent.parallel.launch import free_port
from slipstream.agent.server import cli_flags

MAX_MODEL_LEN_TOKENS = 2048
NUM_KV_BLOCKS = 512
SERVED_MODEL_NAME = "tiny-test"
POOL_LABEL = "short"
SERVER_START_TIMEOUT_S = 180.0
ROUTER_LONG_THRESHOLD_TOKENS = 48  # prompts this long go to the long pool in router tests


class ServerHandle:
    """Where the server listens, plus readers for its Prometheus metrics."""

    def __init__(self, base_url: str, process: subprocess.Popen, control_port: int) -> None:
        self.base_url = base_url
        self.process = process
        self.control_target = f"127.0.0.1:{control_port}"  # the gRPC control API
        self.model = SERVED_MODEL_NAME

    def openai_client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
                             **kwargs)

    def async_openai_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused",
                                  max_retries=0, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample in ``/metrics`` (0 when the series does not exist yet)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    return sample.value
        return 0.0

    def wait_for_metric(self, name: str, expected: float, timeout_s: float = 15.0,
                        **labels: str) -> float:
        """Poll until the metric equals ``expected``; return the last value seen."""
        deadline = time.monotonic() + timeout_s
        value = self.metric(name, **labels)
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            value = self.metric(name, **labels)
        return value


def _slipstream(*args: str) -> list[str]:
    return [sys.executable, "-m", "slipstream.cli", *args]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run(_slipstream("make-tiny-model", str(model_dir)), check=True, timeout=300)
    return model_dir


def serve_command(model_dir: Path, *extra_args: str, pool: str = POOL_LABEL,
                  auto_profile: bool = False, env: dict[str, str | None] | None = None
                  ) -> tuple[list[str], dict[str, str], int, int]:
    """(argv, environment, port, control port) of a ``slipstream serve`` on free ports. It
    gets ``--no-profile`` unless ``auto_profile`` (or ``--profile DIR``); ``env`` adds
    variables to this process's environment (None: unset it)."""
    port, control_port = free_port(), free_port()
    environment = {**os.environ, "SLIPSTREAM_POOL": pool}
    environment.pop("POD_IP", None)
    for name, value in (env or {}).items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    profile = [] if auto_profile or "--profile" in extra_args else ["--no-profile"]
    argv = _slipstream("serve", "--model", str(model_dir), "--port", str(port),
                       "--served-model-name", SERVED_MODEL_NAME, "--device", "cpu",
                       "--max-model-len", str(MAX_MODEL_LEN_TOKENS),
                       "--num-kv-blocks", str(NUM_KV_BLOCKS), "--log-level", "warning",
                       "--control-port", str(control_port), *profile, *extra_args)
    return argv, environment, port, control_port


@contextlib.contextmanager
def serve(model_dir: Path, log_dir: Path, *extra_args: str, pool: str = POOL_LABEL,
          auto_profile: bool = False, env: dict[str, str | None] | None = None
          ) -> Iterator[ServerHandle]:
    """Run ``slipstream serve`` on a free port until the block ends (then stop it by PID)."""
    argv, environment, port, control_port = serve_command(
        model_dir, *extra_args, pool=pool, auto_profile=auto_profile, env=env)
    base_url = f"http://127.0.0.1:{port}"
    with local_process.running(argv, log_dir / "serve.log", f"{base_url}/health",
                               env=environment, timeout_s=SERVER_START_TIMEOUT_S) as process:
        yield ServerHandle(base_url, process, control_port)


@pytest.fixture(scope="session")
def serve_process(tiny_model_dir: Path):
    """``with serve_process(log_dir, *flags) as handle:`` a server of the test's own (one it
    may signal or stop), stopped when the block ends."""
    return lambda log_dir, *extra_args, **kwargs: serve(tiny_model_dir, log_dir, *extra_args,
                                                        **kwargs)


@pytest.fixture(scope="session")
def serve_argv(tiny_model_dir: Path):
    """``serve_argv(*flags, auto_profile=..., env=...)``: (argv, environment, port, control
    port) of a server of the session's tiny model, for a test that runs the process itself."""
    return lambda *extra_args, **kwargs: serve_command(tiny_model_dir, *extra_args, **kwargs)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerHandle]:
    with serve(tiny_model_dir, tmp_path_factory.mktemp("server")) as handle:
        yield handle


def _default_layout() -> str:
    """The engine layout ``slipstream serve`` picks without a flag: "process" (the engine core
    in a process of its own) or "thread" (on a thread of the server process)."""
    single = cli_flags.parse_serve_config([]).server.single_process
    return "thread" if single else "process"


DEFAULT_LAYOUT = _default_layout()


@pytest.fixture(scope="session")
def other_layout_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[ServerHandle]:
    """The session's second server: the engine layout that is not the default."""
    flag = "--no-engine-process" if DEFAULT_LAYOUT == "process" else "--engine-process"
    with serve(tiny_model_dir, tmp_path_factory.mktemp("server"), flag) as handle:
        yield handle


@pytest.fixture(params=["thread", "process"])
def layout_server(request: pytest.FixtureRequest) -> ServerHandle:
    """A server of each engine layout in turn (one per session each), for the API features
    whose state crosses the engine-core wire (grammars, tool calls, choices)."""
    name = "server" if request.param == DEFAULT_LAYOUT else "other_layout_server"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def start_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A factory for servers with extra ``slipstream serve`` flags; all stop at session end."""
    with contextlib.ExitStack() as stack:
        def start(*extra_args: str, pool: str = POOL_LABEL) -> ServerHandle:
            return stack.enter_context(serve(tiny_model_dir, tmp_path_factory.mktemp("server"),
                                             *extra_args, pool=pool))
        yield start


class RouterHandle:
    """A running ``slipstream router``: its URL, an openai client and its metrics."""

    def __init__(self, base_url: str, process: subprocess.Popen) -> None:
        self.base_url = base_url
        self.process = process

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v
                                                  for k, v in labels.items()))

    def wait_for_metric(self, name: str, expected: float, timeout_s: float = 15.0,
                        **labels: str) -> float:
        """Poll until the (summed) metric equals ``expected``; return the last value seen. A
        stream is counted when the router's side of it ends, which may be just after the
        client has read its last event."""
        deadline = time.monotonic() + timeout_s
        value = self.metric(name, **labels)
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            value = self.metric(name, **labels)
        return value


@contextlib.contextmanager
def _run_router(model_dir: Path, log_dir: Path, backends: list[str], *extra: str
               ) -> Iterator[RouterHandle]:
    """Run ``slipstream router`` over ``backends`` ("URL=pool") until the block ends."""
    port = free_port()
    args = [sys.executable, "-m", "slipstream.cli", "router", "--model", str(model_dir),
            "--port", str(port),
            "--long-prefill-threshold-tokens", str(ROUTER_LONG_THRESHOLD_TOKENS),
            "--log-level", "warning", *extra]
    for backend in backends:
        args += ["--backend", backend]
    env = {key: value for key, value in os.environ.items() if key != "POD_IP"}
    base_url = f"http://127.0.0.1:{port}"
    with local_process.running(args, log_dir / f"router-{port}.log", f"{base_url}/health",
                               env=env, timeout_s=60, grace_s=15) as process:
        yield RouterHandle(base_url, process)


@pytest.fixture(scope="session")
def run_router():
    """``run_router(model_dir, log_dir, backends, *flags)``: a router for one block."""
    return _run_router


@pytest.fixture(scope="session")
def serve_model():
    """``with serve_model(model_dir, log_dir, *flags) as handle:`` a server of any model."""
    return serve
