"""The engine in its own process (the default): the same answers as the engine on a thread
of the server process (``--single-process``: text, stop strings, token counts), and when the
engine-core process dies the server fails what was in flight, refuses new work with 503 and
exits non-zero, never hanging."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil

EXIT_BOUND_S = 20.0
EXIT_ENGINE_DEAD = 3
PROMPTS = ["The quick brown fox", "Once upon a time", "a b c d e f", "hello"]


def _spawned(server_pid: int) -> list[psutil.Process]:
    """Children started by multiprocessing's spawn (the resource tracker runs other code)."""
    return [child for child in psutil.Process(server_pid).children()
            if "spawn_main" in " ".join(child.cmdline())]


def _core_process(server_pid: int) -> psutil.Process:
    cores = _spawned(server_pid)
    assert len(cores) == 1, [c.cmdline() for c in psutil.Process(server_pid).children()]
    return cores[0]


def _answers(base_url: str, model: str) -> list[tuple[str, str, int]]:
    results = []
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
            plain = client.post(f"{base_url}/v1/completions", json=body).json()
            text = plain["choices"][0]["text"]
            results.append((text, plain["choices"][0]["finish_reason"],
                            plain["usage"]["completion_tokens"]))
            if len(text) >= 6:  # the same request cut by a stop string from its own output
                stopped = client.post(f"{base_url}/v1/completions",
                                      json={**body, "stop": [text[3:5]]}).json()
                results.append((stopped["choices"][0]["text"],
                                stopped["choices"][0]["finish_reason"],
                                stopped["usage"]["completion_tokens"]))
    return results


def test_engine_process_answers_like_the_engine_thread(server, start_server):
    assert _core_process(server.process.pid) is not None  # the default: two processes
    split_answers = _answers(server.base_url, server.model)
    single = start_server("--single-process")
    assert not _spawned(single.process.pid)
    thread_answers = _answers(single.base_url, single.model)
    assert split_answers == thread_answers
    assert any(reason == "stop" for _, reason, _ in split_answers), split_answers


def _maps_torch(process: psutil.Process) -> bool:
    return any("libtorch" in region.path for region in process.memory_maps())


def test_the_api_process_never_loads_torch(server):
    """Only the engine core pays for torch and the model: the HTTP process starts light, so
    it is up as soon as the core is, even on a loaded machine."""
    api = psutil.Process(server.process.pid)
    assert not _maps_torch(api)
    assert _maps_torch(_core_process(server.process.pid))


def test_killed_engine_core_fails_requests_and_exits_nonzero(start_server):
    server = start_server()
    core = _core_process(server.process.pid)
    body = {"model": server.model, "prompt": "a long answer please", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True}
    answers: list[httpx.Response] = []
    blocking = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)))
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{server.base_url}/v1/completions",
            json={**body, "stream": True}) as stream:
        blocking.start()
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        # Both requests are in the engine (the stats cross from the core after each step).
        assert server.wait_for_metric("slipstream_queue_depth", 2.0, timeout_s=30,
                                      state="running") == 2.0
        os.kill(core.pid, signal.SIGKILL)
        killed_s = time.monotonic()
        rest = "\n".join(lines)
    blocking.join(timeout=EXIT_BOUND_S)
    assert answers, "the non-streaming request did not come back"
    assert answers[0].status_code in (500, 503), answers[0].text
    assert answers[0].json()["error"]["code"] in ("engine_dead", "engine_unavailable")
    assert '"engine_dead"' in rest and rest.rstrip().endswith("data: [DONE]")
    code = server.process.wait(timeout=EXIT_BOUND_S)
    assert time.monotonic() - killed_s < EXIT_BOUND_S
    assert code == EXIT_ENGINE_DEAD

