"""The router's placement for disaggregated deployments, without a network: decode
instances never take a prefill (nor prefill instances a decode leg), and a decode leg goes
to the decode instance holding the least KV, skipping one whose KV would overflow."""

from __future__ import annotations

import asyncio

from slipstream.agent.router.classify import RoutedRequest
from slipstream.agent.router.disagg import chainable
from slipstream.agent.router.instances import AgentReport, InstanceTable

from tests.unit.test_router_routing import ManualClock, make_dispatcher, spec


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
