"""Clients that leave free their KV cache at once; many concurrent streams leak nothing."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

KV_USED = "slipstream_kv_cache_blocks_used"
ABORTED = "slipstream_requests_total"
LONG_GENERATION = {"max_tokens": 1900, "ignore_eos": True, "temperature": 0}


def _idle_baseline(server) -> float:
    """KV blocks in use with nothing in flight (waits out earlier tests' stragglers)."""
    assert server.wait_for_metric("slipstream_queue_depth", 0, state="running") == 0
    return server.metric(KV_USED)


def test_stream_disconnect_frees_kv_blocks(server):
    baseline = _idle_baseline(server)
    aborted_before = server.metric(ABORTED, finish_reason="abort")
    body = {"model": server.model, "messages": [{"role": "user", "content": "Go on forever."}],
            "stream": True, **LONG_GENERATION}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            # Keep the iterator alive: abandoning it would close the connection right away.
            lines = resp.iter_lines()
            data_lines = [line for line in itertools.islice(lines, 10) if line]
            assert len(data_lines) == 5 and all(line.startswith("data: {") for line in data_lines)
            assert server.metric(KV_USED) > baseline  # the request holds KV while streaming
        # Leaving the block closes the connection mid-stream.
    assert server.wait_for_metric(KV_USED, baseline) == baseline
    assert server.wait_for_metric(ABORTED, aborted_before + 1, finish_reason="abort") \
        == aborted_before + 1


def test_non_streaming_disconnect_frees_kv_blocks(server):
    baseline = _idle_baseline(server)
    aborted_before = server.metric(ABORTED, finish_reason="abort")
    body = {"model": server.model, "prompt": "A very long answer:", **LONG_GENERATION}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body,
                   timeout=httpx.Timeout(30, read=0.5))
    assert server.wait_for_metric(ABORTED, aborted_before + 1, finish_reason="abort") \
        == aborted_before + 1
    assert server.wait_for_metric(KV_USED, baseline) == baseline


async def _stream_chat(client, model: str, index: int, leave_after_chunks: int | None):
    stream = await client.chat.completions.create(
        model=model, max_tokens=24, temperature=0.7, seed=index, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Request number {index}, say something."}],
        extra_body={"ignore_eos": True, "app_id": f"app-{index % 3}"})
    chunks, finish_reason, usage = 0, None, None
    async for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
        if leave_after_chunks is not None and chunks == leave_after_chunks:
            await stream.close()
            return "left", chunks, None
    return finish_reason, chunks, usage


def test_fifty_concurrent_streams_finish_without_leaking_kv(server):
    baseline = _idle_baseline(server)
    leavers = set(range(0, 50, 5))  # every fifth client disconnects after a few chunks

    async def run_all():
        async with server.async_openai_client(timeout=240) as client:
            return await asyncio.gather(*(
                _stream_chat(client, server.model, index, 3 if index in leavers else None)
                for index in range(50)))

    results = asyncio.run(run_all())
    finished = [result for index, result in enumerate(results) if index not in leavers]
    assert len(finished) == 40
    for finish_reason, chunks, usage in finished:
        assert finish_reason == "length"
        assert usage is not None and usage.completion_tokens == 24
        assert chunks >= 3
    assert all(results[index][0] == "left" for index in leavers)
    assert server.wait_for_metric(KV_USED, baseline) == baseline
    assert server.metric("slipstream_queue_depth", state="waiting") == 0
    assert server.metric("slipstream_queue_depth", state="running") == 0
    # And the server still answers normally.
    after = server.openai_client().completions.create(model=server.model, prompt="still here",
                                                       max_tokens=3)
    assert after.usage.completion_tokens == 3
