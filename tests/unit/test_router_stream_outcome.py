"""How the router counts a streamed request whose client leaves: after reading [DONE] it was
served whole (the openai client closes the connection right there, and the router may see
that before it reads the end of the instance's body); before [DONE] it was cancelled."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from slipstream.agent.router.classify import RoutedRequest
from slipstream.agent.router.instances import InstanceTable
from slipstream.agent.router.metrics import RouterMetrics
from slipstream.agent.router.proxy import Proxy

from tests.unit.test_router_routing import ManualClock, make_config, make_dispatcher, spec


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": None}]}).encode() + b"\n\n"


# The role-free first token, two more, then [DONE] split across two reads, then a last
# (empty) read the client never waits for.
UPSTREAM = [_event("a"), _event("b"), _event("c"), b"data: [DO", b"NE]\n\n", b""]


def _outcomes(metrics: RouterMetrics) -> dict[str, float]:
    """The outcomes counted (the registry starts every series at zero)."""
    return {sample.labels["outcome"]: sample.value
            for family in metrics.registry.collect() for sample in family.samples
            if sample.name == "slipstream_router_requests_total" and sample.value}


def _run(reads_before_leaving: int) -> tuple[dict[str, float], bytes]:
    async def agent_body():
        for chunk in UPSTREAM:
            yield chunk

    def agent(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=agent_body(),
                              headers={"content-type": "text/event-stream"})

    async def run() -> tuple[dict[str, float], bytes]:
        table = InstanceTable(clock=ManualClock())
        table.upsert(spec("s1", "short"))
        metrics = RouterMetrics()
        proxy = Proxy(make_config(), make_dispatcher(table),
                      httpx.AsyncClient(transport=httpx.MockTransport(agent)), metrics)
        routed = RoutedRequest("short", 3, "default", True, 8, None, 0.0)
        response = await proxy.forward("/v1/completions", b"{}", {}, routed)
        body = response.body_iterator
        read = b""
        for _ in range(reads_before_leaving):
            read += await body.__anext__()
        await body.aclose()  # the client went away
        return _outcomes(metrics), read

    return asyncio.run(run())


def test_a_client_that_leaves_right_after_done_was_served():
    # Reads: the held prefix (up to the first token), "b", "c", "[DO", "NE]".
    outcomes, read = _run(reads_before_leaving=5)
    assert read.endswith(b"data: [DONE]\n\n")
    assert outcomes == {"ok": 1.0}


@pytest.mark.parametrize("reads", [1, 4])
def test_a_client_that_leaves_before_done_is_cancelled(reads):
    outcomes, read = _run(reads_before_leaving=reads)
    assert b"[DONE]" not in read
    assert outcomes == {"cancelled": 1.0}
