"""The router's placement for disaggregated deployments, without a network: decode
instances never take a prefill (nor prefill instances a decode leg), and a decode leg goes
to the decode instance holding the least KV, skipping one whose KV would overflow."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from slipstream.agent.router.classify import COMPLETIONS, RoutedRequest
from slipstream.agent.router.disagg import DisaggChain, chainable
from slipstream.agent.router.instances import AgentReport, InstanceTable
from slipstream.agent.router.metrics import RouterMetrics
from slipstream.agent.router.proxy import Proxy

from tests.unit.test_router_routing import ManualClock, make_config, make_dispatcher, spec


def _routed(request_class: str, prompt_tokens: int) -> RoutedRequest:
    return RoutedRequest(request_class, prompt_tokens, "default", False, 16, None, 0.0)


def _table(*specs) -> InstanceTable:
    table = InstanceTable(clock=ManualClock())
    for s in specs:
        table.upsert(s)
    return table


def test_decode_instances_serve_only_decode_legs():
    table = _table(spec("p1", "short"), spec("d1", "decode"), spec("d22", "decode"))
    assert {i.name for i in table.candidates("short")} == {"p1"}
    assert {i.name for i in table.candidates("long")} == {"p1"}  # fallback: not to decode
    assert {i.name for i in table.candidates("decode")} == {"d1", "d22"}
    assert table.has_decode_instances()
    assert not _table(spec("p1", "short")).has_decode_instances()
    assert _table(spec("p1", "short")).candidates("decode") == []


def test_a_decode_leg_goes_to_the_instance_holding_the_least_kv():
    table = _table(spec("d1", "decode"), spec("d22", "decode"), spec("p1", "short"))
    dispatcher = make_dispatcher(table)

    async def place(prompt_tokens: int):
        return await dispatcher.acquire(_routed("decode", prompt_tokens), 0.0)

    first = asyncio.run(place(900))  # one long request on one instance...
    second = asyncio.run(place(10))  # ...so the next goes to the other one,
    third = asyncio.run(place(10))   # and so does the one after (20 < 900 tokens of KV)
    assert first.instance.pool == "decode" and second.instance is not first.instance
    assert third.instance is second.instance
    # Reports count other routers' requests too: d22 now holds a lot of foreign KV.
    other = table.get("d22" if first.instance.name == "d1" else "d1")
    assert other is second.instance
    other.report(AgentReport(prefill_requests=0, decode_requests=40, kv_capacity_tokens=None))
    table.observe_prompt("decode", 100)
    assert asyncio.run(place(10)).instance is first.instance


def test_a_decode_instance_whose_kv_would_overflow_is_skipped():
    table = _table(spec("d1", "decode"), spec("d22", "decode"))
    dispatcher = make_dispatcher(table)
    for name, capacity in (("d1", 1000), ("d22", 100_000)):
        instance = table.get(name)
        assert instance is not None
        instance.report(AgentReport(0, 0, kv_capacity_tokens=capacity))
    busy = asyncio.run(dispatcher.acquire(_routed("decode", 10), 0.0))
    assert busy.instance.name in {"d1", "d22"}
    # d1 holds 10 tokens (or none); a 995-token prompt fits only d22 once d1 is busy.
    if busy.instance.name == "d22":
        busy = asyncio.run(dispatcher.acquire(_routed("decode", 10), 0.0))
    assert busy.instance.name == "d1"
    assert asyncio.run(dispatcher.acquire(_routed("decode", 995), 0.0)).instance.name == "d22"


def test_only_plain_requests_are_chained():
    assert chainable({"prompt": "hi"})
    assert not chainable({"prompt": "hi", "logprobs": 2})
    assert not chainable({"messages": [], "top_logprobs": 1, "logprobs": True})
    assert not chainable({"prompt": "hi", "echo": True})
    assert not chainable({"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}})
    assert not chainable(None)


# ---- the chain's order of events, against scripted agents (httpx.MockTransport) ----------
# The real agents and Mooncake are in tests/server/test_disagg_serving.py; these scripts pin
# down what the router does at each turn, including the turns real agents rarely take.

PREFILL, DECODE = spec("p1", "short"), spec("d333", "decode")  # distinct ports
STREAMING_HANDLE = {"transfer_id": "t1", "transport": "mooncake", "side_channel": "tcp://x",
                    "endpoint": "x", "block_ids": [], "first_token_id": -1, "streaming": True}
COMPLETE_HANDLE = {**STREAMING_HANDLE, "block_ids": [1, 2], "first_token_id": 7,
                   "streaming": False}


def _sse(*events: dict) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _chunk(text: str, finish_reason: str | None = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}


def _chain(agent, table: InstanceTable | None = None) -> DisaggChain:
    if table is None:
        table = InstanceTable(clock=ManualClock())
        table.upsert(PREFILL)
        table.upsert(DECODE)
    proxy = Proxy(make_config(), make_dispatcher(table),
                  httpx.AsyncClient(transport=httpx.MockTransport(agent)), RouterMetrics())
    return DisaggChain(proxy, table)


async def _forward(chain: DisaggChain, body: dict) -> tuple[int, bytes]:
    routed = RoutedRequest("short", 3, "default", bool(body.get("stream")), 8, None, 0.0)
    response = await chain.forward("/v1/completions", COMPLETIONS, body, {}, routed)
    if hasattr(response, "body_iterator"):
        return response.status_code, b"".join([chunk async for chunk in response.body_iterator])
    return response.status_code, bytes(response.body)


def test_the_decode_leg_starts_on_the_early_handle_before_the_prompt_is_done():
    """The scripted prefill stream sends its first token only after the decode leg has
    arrived: the chain completes only if the decode leg starts on the first event."""
    async def run() -> tuple[int, bytes, list]:
        decode_arrived = asyncio.Event()
        calls = []

        async def prefill_stream():
            yield _sse({"object": "slipstream.kv_transfer", "kv_transfer_params":
                        STREAMING_HANDLE})[0]
            await asyncio.wait_for(decode_arrived.wait(), 10)
            for chunk in _sse(_chunk(" a", "length"), {"object": "slipstream.kv_transfer",
                                                       "kv_transfer_params": COMPLETE_HANDLE}):
                yield chunk

        async def agent(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            calls.append((request.url.port, body["stream"], body["kv_transfer_params"]))
            if request.url.port == httpx.URL(PREFILL.url).port:
                return httpx.Response(200, content=prefill_stream(),
                                      headers={"content-type": "text/event-stream"})
            decode_arrived.set()
            return httpx.Response(200, json={**_chunk(" a b c", "length"), "usage": None})

        status, content = await _forward(_chain(agent), {"prompt": "x", "stream": False})
        return status, content, calls

    status, content, calls = asyncio.run(run())
    assert status == 200 and json.loads(content)["choices"][0]["text"] == " a b c"
    (prefill_port, prefill_stream, asked), (_, _, handle) = calls
    assert prefill_stream is True and asked == {"do_remote_decode": True}
    assert handle == {**STREAMING_HANDLE, "do_remote_prefill": True}


def test_a_prefill_ending_at_its_first_token_cancels_the_decode_leg():
    async def run() -> tuple[int, bytes, bool]:
        decode_cancelled = asyncio.Event()
        decode_arrived = asyncio.Event()

        async def prefill_stream():
            yield _sse({"object": "slipstream.kv_transfer", "kv_transfer_params":
                        STREAMING_HANDLE})[0]
            await asyncio.wait_for(decode_arrived.wait(), 10)
            for chunk in _sse(_chunk(" end", "stop")):
                yield chunk

        async def agent(request: httpx.Request) -> httpx.Response:
            if request.url.port == httpx.URL(PREFILL.url).port:
                return httpx.Response(200, content=prefill_stream(),
                                      headers={"content-type": "text/event-stream"})
            decode_arrived.set()
            try:
                await asyncio.sleep(30)  # waiting for KV that will never be complete
            except asyncio.CancelledError:
                decode_cancelled.set()
                raise
            raise AssertionError("the decode leg was not cancelled")

        status, content = await _forward(_chain(agent), {"prompt": "x", "stream": True})
        return status, content, decode_cancelled.is_set()

    status, content, cancelled = asyncio.run(run())
    assert status == 200 and cancelled
    events = [json.loads(line[6:]) for line in content.decode().split("\n\n")
              if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events] == [" end"]  # no handle, no usage
    assert events[0]["choices"][0]["finish_reason"] == "stop"
    assert content.endswith(b"data: [DONE]\n\n")


def test_a_prefill_agent_without_streamed_legs_gets_the_unstreamed_chain():
    """An agent from before streamed hand-offs refuses stream=true with do_remote_decode
    (a 400 on ``stream``): the router asks it again with stream=false and chains as before."""
    calls = []

    def agent(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.port, body.get("stream"), body["kv_transfer_params"]))
        if request.url.port == httpx.URL(PREFILL.url).port:
            if body["stream"]:
                return httpx.Response(400, json={"error": {
                    "message": "kv_transfer_params.do_remote_decode needs stream=false: the "
                               "KV handle comes back in the response body",
                    "type": "invalid_request_error", "param": "stream", "code": None}})
            return httpx.Response(200, json={**_chunk(" a", "length"), "usage": None,
                                             "kv_transfer_params": COMPLETE_HANDLE})
        return httpx.Response(200, json={**_chunk(" a b", "length"), "usage": None})

    status, content = asyncio.run(_forward(_chain(agent), {"prompt": "x"}))
    assert status == 200 and json.loads(content)["choices"][0]["text"] == " a b"
    assert [(stream, params.get("do_remote_prefill", False)) for _, stream, params in calls] \
        == [(True, False), (False, False), (None, True)]
    assert calls[2][2] == {**COMPLETE_HANDLE, "do_remote_prefill": True}


def test_a_decode_leg_refused_because_the_prefill_ended_at_its_first_token():
    """The race the real agents run: the prefill ends at its first token and drops its hold;
    the decode instance, reading that hold, answers 503 kv_transfer_failed before the
    router has the prefill's end. The client still gets the prefill's answer, and the decode
    instance is not put in cooldown (it did nothing wrong): the next request reaches it."""
    decode_calls = []

    async def run() -> list[tuple[int, bytes]]:
        decode_refused = asyncio.Event()

        async def prefill_stream():
            yield _sse({"object": "slipstream.kv_transfer", "kv_transfer_params":
                        STREAMING_HANDLE})[0]
            await asyncio.wait_for(decode_refused.wait(), 10)
            await asyncio.sleep(0.2)  # the refusal reaches the router first
            for chunk in _sse(_chunk(" end", "stop")):
                yield chunk

        async def agent(request: httpx.Request) -> httpx.Response:
            if request.url.port == httpx.URL(PREFILL.url).port:
                return httpx.Response(200, content=prefill_stream(),
                                      headers={"content-type": "text/event-stream"})
            decode_calls.append(json.loads(request.content)["kv_transfer_params"])
            decode_refused.set()
            return httpx.Response(503, json={"error": {
                "message": "the KV cache of this request could not be fetched from its "
                           "prefill instance", "type": "server_error", "param": None,
                "code": "kv_transfer_failed"}})

        chain = _chain(agent)
        results = []
        for _ in range(2):
            decode_refused.clear()
            results.append(await _forward(chain, {"prompt": "x"}))
        return results

    for status, content in asyncio.run(run()):
        assert status == 200, content
        answer = json.loads(content)
        assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == \
            (" end", "stop")
    assert len(decode_calls) == 2


def test_sequential_chains_spread_decode_legs_over_idle_decode_instances():
    """Issue 30: each chain places a prefill and then a decode leg. With one tie-break
    counter for both choices, the decode choice always saw the same rotation parity, and six
    sequential requests all went to one of two idle decode instances."""
    table = _table(spec("p1", "short"), spec("d1", "decode"), spec("d22", "decode"))
    dispatcher = make_dispatcher(table)

    async def one_request() -> str:
        prefill = await dispatcher.acquire(_routed("short", 10), 0.0)
        decode = await dispatcher.acquire(_routed("decode", 10), 0.0)
        prefill.first_token()
        prefill.finish(1)
        decode.first_token()
        decode.finish(4)
        return decode.instance.name

    used = [asyncio.run(one_request()) for _ in range(6)]
    assert sorted(set(used)) == ["d1", "d22"]
    assert used.count("d1") == used.count("d22") == 3


def test_sequential_prefills_spread_over_idle_prefill_instances_too():
    table = _table(spec("p1", "short"), spec("p22", "short"), spec("d1", "decode"))
    dispatcher = make_dispatcher(table)

    async def one_request() -> str:
        prefill = await dispatcher.acquire(_routed("short", 10), 0.0)
        decode = await dispatcher.acquire(_routed("decode", 10), 0.0)
        for lease in (prefill, decode):
            lease.first_token()
            lease.finish(1)
        return prefill.instance.name

    used = [asyncio.run(one_request()) for _ in range(4)]
    assert used.count("p1") == used.count("p22") == 2


def _recording_agent(calls: list, decode_status: int | None):
    """A prefill agent that hands off at once (the prompt is done before the decode leg
    could start) and serves plain requests whole; a decode agent that answers
    ``decode_status`` (None: refuses the connection)."""
    def agent(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        calls.append((request.url.port, request.url.path, body))
        if request.url.port != httpx.URL(PREFILL.url).port:
            if decode_status is None:
                raise httpx.ConnectError("connection refused")
            return httpx.Response(decode_status, json={"error": {
                "message": "no room", "type": "server_error", "param": None,
                "code": "no_instance_available"}})
        if request.url.path.endswith("/kv_transfer/release"):
            return httpx.Response(200, json={"released": True})
        if body.get("kv_transfer_params"):
            return httpx.Response(200, content=b"".join(_sse(
                {"object": "slipstream.kv_transfer", "kv_transfer_params": STREAMING_HANDLE},
                _chunk(" a", "length"),
                {"object": "slipstream.kv_transfer", "kv_transfer_params": COMPLETE_HANDLE})),
                headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={**_chunk(" whole answer", "length"), "usage": None})
    return agent


@pytest.mark.parametrize("decode_status", [None, 503])
def test_a_chain_whose_decode_leg_finds_no_instance_is_served_whole_and_frees_the_hold(
        decode_status):
    """Issue 30: with no decode instance to take the leg, the router ran the prefill twice,
    answered 503 and left the KV held until the hold timeout. Now the hold is released at
    once and a prefill instance serves the request whole."""
    calls: list = []
    table = InstanceTable()  # the proxy marks failures on the real clock
    table.upsert(PREFILL)
    table.upsert(DECODE)
    status, content = asyncio.run(_forward(_chain(_recording_agent(calls, decode_status), table),
                                           {"prompt": "x"}))
    assert status == 200, content
    assert json.loads(content)["choices"][0]["text"] == " whole answer"
    prefill_port = httpx.URL(PREFILL.url).port
    to_prefill = [(path, body) for port, path, body in calls if port == prefill_port]
    chained = [body for path, body in to_prefill if body.get("kv_transfer_params")]
    released = [body for path, body in to_prefill if path.endswith("/kv_transfer/release")]
    whole = [body for path, body in to_prefill
             if path == "/v1/completions" and not body.get("kv_transfer_params")]
    assert len(chained) == 1  # one prefill leg, not two
    assert released == [{"transfer_id": STREAMING_HANDLE["transfer_id"]}]
    assert whole == [{"prompt": "x"}]


def test_with_no_decode_instance_serving_requests_are_not_chained():
    calls: list = []
    table = _table(PREFILL, DECODE)
    decode = table.get(DECODE.name)
    assert decode is not None
    decode.polled("not_serving", 0.0, "connection refused")  # as the stats poller finds it
    assert table.has_decode_instances() and not table.decode_available()
    status, content = asyncio.run(_forward(_chain(_recording_agent(calls, 200), table),
                                           {"prompt": "x", "max_tokens": 4}))
    assert status == 200 and json.loads(content)["choices"][0]["text"] == " whole answer"
    assert [(path, body) for _, path, body in calls] == [
        ("/v1/completions", {"prompt": "x", "max_tokens": 4})]
