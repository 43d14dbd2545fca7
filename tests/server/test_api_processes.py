"""`slipstream serve --api-processes 2`: two HTTP processes on one port (SO_REUSEPORT) share
one engine core. Streams through both complete (official openai client), /metrics adds up
both processes' request counters whichever process answers the scrape, a drain ends both,
and a dead core fails the streams of both and ends the server with 3."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import psutil
import pytest

from slipstream.agent.server import cli_flags

NUM_STREAMS = 16  # all on one of the two processes: probability 2**-15
OUTPUT_TOKENS = 200  # every stream still open (or kept alive) while the connections are counted
LONG_OUTPUT_TOKENS = 1500  # still running when the core is killed
START_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 60.0
EXIT_ENGINE_DEAD = 3


def _port(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def _family(server) -> list[psutil.Process]:
    root = psutil.Process(server.process.pid)
    return [root, *root.children(recursive=True)]


def _sockets(process: psutil.Process, port: int, status: str) -> list:
    """``process``'s TCP sockets on local ``port`` in ``status``."""
    try:
        return [connection for connection in process.net_connections(kind="tcp")
                if connection.status == status and connection.laddr
                and connection.laddr.port == port]
    except psutil.Error:
        return []


class _Accepted:
    """Which API process holds each client connection, sampled until ``stop``. A stream whose
    200 tokens all fit in the socket buffers is finished on the server's side while its client
    waits at the barrier, and after the keep-alive timeout the server closes that connection:
    one look at the end would miss it, so the connections are collected while they open."""

    def __init__(self, api: list[psutil.Process], port: int) -> None:
        self.peers: list[set[int]] = [set() for _ in api]
        self._api, self._port = api, port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            last = self._stop.is_set()
            for seen, process in zip(self.peers, self._api):
                seen.update(connection.raddr.port for connection
                            in _sockets(process, self._port, psutil.CONN_ESTABLISHED))
            if last:
                return
            self._stop.wait(0.02)

    def stop(self) -> list[int]:
        """Stop sampling (after one last look); the connections each process held."""
        self._stop.set()
        self._thread.join(timeout=START_TIMEOUT_S)
        return [len(seen) for seen in self.peers]


def _api_processes(server) -> list[psutil.Process]:
    """The server's processes listening on its port, once there are two (the second starts
    when the first serves)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        listening = [process for process in _family(server)
                     if _sockets(process, _port(server), psutil.CONN_LISTEN)]
        if len(listening) == 2:
            return listening
        time.sleep(0.25)
    raise AssertionError(f"not two API processes on port {_port(server)}: "
                         f"{[p.cmdline() for p in _family(server)]}")


def _core(server, api: list[psutil.Process]) -> psutil.Process:
    pids = {process.pid for process in api}
    [core] = [process for process in _family(server)[1:]
              if process.pid not in pids and "spawn_main" in " ".join(process.cmdline())]
    return core


def _exited(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _all_exit(processes: list[psutil.Process]) -> bool:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while not all(_exited(process) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_exited(process) for process in processes)


class _Streams:
    """``NUM_STREAMS`` streaming completions, each on a client (and so a connection) of its
    own; each waits at ``first_chunks`` after its first chunk, with the test."""

    def __init__(self, server, max_tokens: int) -> None:
        self.first_chunks = threading.Barrier(NUM_STREAMS + 1, timeout=START_TIMEOUT_S)
        self.results: list[tuple[str, str | None]] = []  # (text, finish_reason)
        self.errors: list[Exception] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._one, args=(server, max_tokens),
                                          daemon=True) for _ in range(NUM_STREAMS)]
        for thread in self._threads:
            thread.start()

    def _one(self, server, max_tokens: int) -> None:
        held = False
        try:
            stream = server.openai_client(timeout=120).completions.create(
                model=server.model, prompt="a b c", max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            text, reason = "", None
            for chunk in stream:
                if not chunk.choices:
                    continue
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
                if not held:
                    held = True
                    self.first_chunks.wait()
            with self._lock:
                self.results.append((text, reason))
        except Exception as error:  # noqa: BLE001 - the test reads them
            with self._lock:
                self.errors.append(error)
            if not held:
                self.first_chunks.abort()  # the test's wait fails now, not at the timeout

    def wait_for_first_chunks(self) -> None:
        try:
            self.first_chunks.wait()
        except threading.BrokenBarrierError:
            self.join()
            raise AssertionError(f"a stream failed before its first chunk: {self.errors}")

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=START_TIMEOUT_S)


def test_streams_through_both_api_processes_complete_and_metrics_add_up(start_server):
    server = start_server("--api-processes", "2")
    api = _api_processes(server)
    port = _port(server)
    finished_before = server.metric("slipstream_requests_total", finish_reason="length")
    generated_before = server.metric("slipstream_generation_tokens_total")

    accepted = _Accepted(api, port)
    streams = _Streams(server, OUTPUT_TOKENS)
    streams.wait_for_first_chunks()  # every stream is open and has its first chunk
    established = accepted.stop()
    assert all(count > 0 for count in established), established
    assert sum(established) >= NUM_STREAMS
    streams.join()
    assert not streams.errors, streams.errors
    assert len(streams.results) == NUM_STREAMS
    assert all(reason == "length" and text for text, reason in streams.results), \
        streams.results

    # Each scrape is a new connection, answered by either process: the merged counters are
    # the same from both, and the engine's own gauges reach both.
    for _ in range(12):
        assert server.metric("slipstream_requests_total", finish_reason="length") == \
            finished_before + NUM_STREAMS
        assert server.metric("slipstream_generation_tokens_total") == \
            generated_before + NUM_STREAMS * OUTPUT_TOKENS
        assert server.metric("slipstream_kv_cache_blocks_capacity") > 0
        assert sum(server.metric("slipstream_requests_in_flight", request_class=c, phase=p)
                   for c in ("short", "long") for p in ("prefill", "decode")) == 0

    # SIGTERM (what Kubernetes sends the pod's first process) drains both; all exit 0.
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert _all_exit(api[1:])


def test_a_dead_engine_core_fails_the_streams_of_every_api_process(start_server):
    server = start_server("--api-processes", "2")
    api = _api_processes(server)
    core = _core(server, api)
    streams = _Streams(server, LONG_OUTPUT_TOKENS)
    streams.wait_for_first_chunks()
    os.kill(core.pid, signal.SIGKILL)
    streams.join()
    # Each stream ended with an error event (the openai client raises on it), none hung.
    assert len(streams.errors) == NUM_STREAMS, (streams.results, streams.errors)
    assert all(isinstance(error, openai.APIError) and error.code == "engine_dead"
               for error in streams.errors), streams.errors
    assert server.process.wait(timeout=EXIT_TIMEOUT_S) == EXIT_ENGINE_DEAD
    assert _all_exit(api[1:])


@pytest.mark.parametrize("flags, message", [
    (["--api-processes", "0"], "greater than or equal to 1"),
    (["--api-processes", "2", "--single-process"], "process of its own"),
    (["--api-processes", "2", "--role", "prefill"], "mixed role only"),
])
def test_api_processes_that_cannot_be_served_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        cli_flags.parse_serve_config(flags)
