"""The load generator behind ``slipstream bench serve``: replay arrivals against any
OpenAI-compatible ``/v1/completions`` endpoint, streaming, and time every token.

    list[TraceRequest] (arrival, prompt and output lengths) --> one task per request:
        wait for its arrival time --> wait for a concurrency slot --> POST, stream=True,
        stream_options.include_usage --> RequestTiming --> serve_metrics.serving_metrics()

Prompts are token-id lists of the requested length (random ids below ``max_token_id``), and
``ignore_eos`` with ``max_tokens`` asks for exactly the requested output length, as vLLM's
random dataset does; output tokens are counted from the server's usage report.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm import tqdm

from slipstream.bench.serve_metrics import RequestTiming
from slipstream.sim.traces import TraceRequest


@dataclass(frozen=True)
class LoadConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    max_concurrency: int | None = None
    max_token_id: int = 1000
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str = "unused"
    progress: bool = True


def make_prompts(requests: list[TraceRequest], max_token_id: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, max_token_id, r.prompt_tokens).tolist() for r in requests]


async def _send(client: httpx.AsyncClient, config: LoadConfig, prompt: list[int],
                max_tokens: int, timing: RequestTiming) -> None:
    body = {"model": config.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    timing.prompt_tokens = len(prompt)
    timing.send_s = time.perf_counter()
    try:
        async with client.stream("POST", f"{config.base_url}/completions", json=body) as reply:
            if reply.status_code != 200:
                timing.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    timing.chunk_times_s.append(now)
                elif choices and not timing.chunk_times_s and choices[0].get("finish_reason"):
                    timing.chunk_times_s.append(now)  # tokens that decode to no text
                usage = chunk.get("usage")
                if usage:
                    timing.output_tokens = int(usage.get("completion_tokens") or 0)
                    timing.prompt_tokens = int(usage.get("prompt_tokens") or timing.prompt_tokens)
        timing.success = bool(timing.chunk_times_s)
        if not timing.success:
            timing.error = "no tokens in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        timing.error = f"{type(error).__name__}: {error}"


async def run_load(requests: list[TraceRequest], config: LoadConfig) -> tuple[list[RequestTiming], float]:
    """Send every request at its arrival time; returns timings and the benchmark duration."""
    prompts = make_prompts(requests, config.max_token_id, config.seed)
    limit = config.max_concurrency or len(requests) or 1
    semaphore = asyncio.Semaphore(limit)
    timings = [RequestTiming(send_s=0.0, scheduled_s=r.arrival_s) for r in requests]
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    headers = {"Authorization": f"Bearer {config.api_key}"}
    progress = tqdm(total=len(requests), unit="req", disable=not config.progress)
    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def one(index: int) -> None:
            delay = start + requests[index].arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore:
                await _send(client, config, prompts[index], requests[index].output_tokens,
                            timings[index])
            progress.update()

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration_s = time.perf_counter() - start
    progress.close()
    for timing in timings:  # relative to the benchmark start, for plots and comparisons
        timing.chunk_times_s = [t - start for t in timing.chunk_times_s]
        timing.send_s -= start
    return timings, duration_s
