"""A server run as a local process by a benchmark or a test: start it, wait until it answers,
stop it.

    running(argv, log, ready_url) --Popen--> wait_ready(): GET ready_url until 200
        --> yield the process --> stop(): SIGTERM, SIGKILL after the grace period

One place for what every live benchmark and server test did with its own copy: fail fast with
the log when the process dies during start-up, and never leave it running.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

LOG_TAIL_CHARS = 4000  # of the process's output, in the error when it does not come up


class ExitedDuringStartup(RuntimeError):
    """The process ended before it answered; ``returncode`` is its exit status (negative: the
    signal that ended it)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def wait_ready(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float,
               period_s: float = 0.25) -> None:
    """Poll ``url`` until it answers 200; raise, with the log's tail, if the process exits
    first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ExitedDuringStartup(f"{process.args!r} exited with {process.returncode}:\n"
                                      f"{_tail(log_path)}", process.returncode)
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(period_s)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s:\n{_tail(log_path)}")


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, and SIGKILL if it is still there after ``grace_s``; reaps it either way."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running(argv: list[str], log_path: Path, ready_url: str, *,
            env: dict[str, str] | None = None, timeout_s: float = 180.0,
            grace_s: float = 30.0) -> Iterator[subprocess.Popen]:
    """``argv`` running with its output in ``log_path``, once ``ready_url`` answers."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(ready_url, process, log_path, timeout_s)
        yield process
    finally:
        stop(process, grace_s)


def _tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"
