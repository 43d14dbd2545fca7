"""The poison test: 100 streams are in flight when requests of every once-poisonous class
arrive. Each poison gets a 200 or a clean 4xx in OpenAI's shape; all 100 streams finish with
the output they have without the poison; KV returns to its baseline. Then the same through
the router with two backends: 0 collateral failures, 1 clean 4xx, and no retries."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.timeout(600)

KV_USED = "slipstream_kv_cache_blocks_used"
NUM_STREAMS = 100
STREAM_TOKENS = 256  # long enough that every stream is still running when the poison comes
# Room for every stream's whole KV, so that none waits on preemption.
KV_BLOCKS = str(2 * NUM_STREAMS * (STREAM_TOKENS + 32) // 16)
INT64_MAX = 2**63 - 1

# Sampling values that once made the batched step raise (killing every request in flight),
# and their neighbours at the edges of what validation accepts. (name, extra body fields,
# expected status)
POISONS = [
    ("temperature 1e-30", {"temperature": 1e-30}, 200),
    ("temperature below float32", {"temperature": 1e-300}, 200),
    ("smallest double temperature", {"temperature": 5e-324}, 200),
    ("top_p below float32", {"top_p": 1e-300, "temperature": 1.0}, 200),
    ("smallest double top_p", {"top_p": 5e-324, "temperature": 1.0}, 200),
    ("top_k at int64 max", {"top_k": INT64_MAX, "temperature": 1.0}, 200),
    ("top_k past int64", {"top_k": 2**63, "temperature": 1.0}, 400),
    ("top_k far past int64", {"top_k": 10**30}, 400),
    ("seed past int64", {"seed": 2**64, "temperature": 1.0}, 400),
    ("seed at int64 min", {"seed": -(2**63), "temperature": 1.0}, 200),
    ("stop token past the vocabulary", {"stop_token_ids": [10**9]}, 400),
    ("stop token past int64", {"stop_token_ids": [2**70]}, 400),
    ("max_tokens past int64", {"max_tokens": 2**70}, 400),
    ("hottest temperature", {"temperature": 100.0, "top_p": 1.0}, 200),
    ("all filters at their edges", {"temperature": 1e-300, "top_p": 5e-324,
                                    "top_k": INT64_MAX, "seed": INT64_MAX}, 200),
    ("tiny slo", {"slo": {"ttft_s": 5e-324, "tpot_ms": 5e-324}, "priority": 1_000_000}, 200),
    ("most logprobs", {"logprobs": 20, "temperature": 1e-30}, 200),
]


def _stream_body(model: str, index: int) -> dict:
    return {"model": model, "prompt": f"Stream {index}: tell me about number {index * 7}.",
            "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, base_url: str, body: dict,
                  started: asyncio.Event | None = None) -> tuple[int, str, str | None]:
    """(status, text, last finish_reason) of one completions stream; ``started`` is set at
    its first event (or its end, if it never got one)."""
    text, finish_reason = [], None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, response.text, None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return 500, json.dumps(event), None
                if started is not None:
                    started.set()
                for choice in event["choices"]:
                    text.append(choice["text"])
                    finish_reason = choice["finish_reason"] or finish_reason
        return 200, "".join(text), finish_reason
    finally:
        if started is not None:
            started.set()


async def _streams_with_poison(base_url: str, model: str, poisons: list[tuple[str, dict, int]]):
    """Start NUM_STREAMS streams; once every one has its first token, send the poisons."""
    limits = httpx.Limits(max_connections=NUM_STREAMS + 32)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        streams = [asyncio.create_task(_stream(client, base_url, _stream_body(model, i), event))
                   for i, event in enumerate(started)]
        answers = []
        if poisons:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 240)
            ended = [task.result() for task in streams if task.done()]
            assert not ended, f"{len(ended)} streams ended before the poison: {ended[:2]}"
            answers = await asyncio.gather(*(
                client.post(f"{base_url}/v1/completions", json={
                    "model": model, "prompt": f"poison: {name}", "max_tokens": 8, **fields})
                for name, fields, _ in poisons))
        return await asyncio.gather(*streams), answers


def _assert_clean(name: str, response: httpx.Response, expected_status: int) -> None:
    assert response.status_code == expected_status, (name, response.text)
    if expected_status == 200:
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop"), name
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, name
    assert error["type"] == "invalid_request_error", name
    assert "Error" not in error["message"] and "Traceback" not in error["message"], name


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--num-kv-blocks", KV_BLOCKS)


def test_poison_requests_hurt_none_of_100_streams(server):
    assert server.wait_for_metric("slipstream_queue_depth", 0, state="running") == 0
    kv_baseline = server.metric(KV_USED)
    expected, _ = asyncio.run(_streams_with_poison(server.base_url, server.model, []))
    assert all(status == 200 and reason == "length" for status, _, reason in expected)

    results, answers = asyncio.run(_streams_with_poison(server.base_url, server.model, POISONS))
    collateral = [i for i, result in enumerate(results) if result != expected[i]]
    assert collateral == [], [results[i] for i in collateral[:3]]
    for (name, _, status), response in zip(POISONS, answers):
        _assert_clean(name, response, status)
    assert server.wait_for_metric(KV_USED, kv_baseline) == kv_baseline
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_through_the_router_one_poison_is_one_clean_4xx(run_router, tiny_model_dir,
                                                        tmp_path_factory, start_server):
    backends = [start_server("--num-kv-blocks", KV_BLOCKS, pool="unified") for _ in range(2)]
    poison = [("top_k past int64", {"top_k": 2**64, "temperature": 1.0}, 400)]
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-poison"),
                    [f"{backend.base_url}=unified" for backend in backends],
                    "--max-in-flight-per-instance", str(2 * NUM_STREAMS)) as router:
        results, answers = asyncio.run(_streams_with_poison(router.base_url, "tiny-test",
                                                            poison))
        assert router.metric("slipstream_router_retries_total") == 0
    collateral = [result for result in results if result[0] != 200 or result[2] != "length"]
    assert collateral == []
    assert [response.status_code for response in answers] == [400]
    _assert_clean(poison[0][0], answers[0], 400)
    for backend in backends:
        assert backend.wait_for_metric(KV_USED, 0) == 0
