"""Start-up errors of a real ``slipstream serve`` process: each bad flag or broken model file
gives one clear line on stderr naming the problem, exit code 2, no traceback and no banner.
And the banner of a good start prints only once the port really serves."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 300  # torch's import alone takes a while on a loaded machine


def serve_argv(model_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "slipstream.cli", "serve", "--model", str(model_dir),
            "--host", "127.0.0.1", "--no-profile", *flags]


def environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "POD_IP"}


def broken_copy(model_dir: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    damage(copy)
    return copy


def truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)


def empty(model: Path) -> None:
    (model / "model.safetensors").write_bytes(b"")


def bad_tokenizer(model: Path) -> None:
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')


def bad_config(model: Path) -> None:
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')


@pytest.fixture
def busy_port():
    """A port another process (here: this one) listens on."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder.getsockname()[1]
    holder.close()


def run_failing(argv: list[str]) -> tuple[int, list[str], str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                          env=environment())
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, lines, done.stdout


def assert_one_clear_line(code: int, lines: list[str], stdout: str, *expected: str) -> None:
    assert code == 2, (code, lines)
    assert len(lines) == 1, "\n".join(lines)
    assert "cannot start:" in lines[0] and all(text in lines[0] for text in expected), lines[0]
    assert "Slipstream serving" not in stdout, stdout


@pytest.mark.parametrize("damage, expected", [
    (truncate, ("model.safetensors", "not a readable safetensors file", "truncated")),
    (empty, ("model.safetensors (0 bytes)", "not a readable safetensors file")),
    (bad_tokenizer, ("tokenizer.json is not a valid tokenizer.json",)),
    (bad_config, ("config.json lacks",)),
], ids=["truncated-safetensors", "empty-safetensors", "bad-tokenizer", "bad-config"])
def test_a_broken_model_directory_is_one_line_and_exit_2(tiny_model_dir, tmp_path, damage,
                                                        expected):
    model = broken_copy(tiny_model_dir, tmp_path, damage)
    assert_one_clear_line(*run_failing(serve_argv(model, "--port", "0", "--control-port", "0")),
                          *expected)


def test_a_tp_that_does_not_divide_the_heads_fails_before_any_worker_starts(tiny_model_dir):
    """Before: 96 lines, with one traceback per worker rank."""
    code, lines, stdout = run_failing(serve_argv(tiny_model_dir, "--tp", "3", "--port", "0",
                                                 "--control-port", "0"))
    assert_one_clear_line(code, lines, stdout, "--tp 3 does not divide this model",
                          "4 attention heads", "--tp may be 1, 2")


def test_a_busy_port_fails_at_once_without_a_banner(tiny_model_dir, busy_port):
    code, lines, stdout = run_failing(serve_argv(tiny_model_dir, "--port", str(busy_port),
                                                 "--control-port", "0"))
    assert_one_clear_line(code, lines, stdout, f"--port {busy_port}", "in use",
                          "pick another --port")


def test_a_busy_control_port_is_one_line(tiny_model_dir, busy_port):
    code, lines, stdout = run_failing(serve_argv(tiny_model_dir, "--port", "0",
                                                 "--control-port", str(busy_port)))
    assert_one_clear_line(code, lines, stdout, f"--control-port {busy_port}", "in use",
                          "or 0 to turn it off")


def test_the_banner_comes_once_the_port_serves_and_names_the_real_port(tiny_model_dir):
    """With --port 0 the kernel picks the port; the banner names it, and the moment the
    banner is out, /health answers 200 there."""
    process = subprocess.Popen(serve_argv(tiny_model_dir, "--port", "0", "--control-port", "0"),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=environment())
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()  # blocks until the banner, or EOF if it died
        assert banner.startswith("Slipstream serving"), (banner, process.poll())
        url = banner.split(" at ", 1)[1].strip().removesuffix("/v1")
        port = int(url.rsplit(":", 1)[1])
        assert port != 0
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert process.returncode == 0
