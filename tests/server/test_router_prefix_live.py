"""Prefix-aware routing, live: two real ``slipstream serve`` agents on the tiny model behind a
real ``slipstream router``, over HTTP with the official ``openai`` client.

Requests that share a long prefix land on the agent that computed it, and that agent's own
prefix-cache hit counter (``slipstream_prefix_cache_hit_tokens_total``) moves by exactly the
``cached_tokens`` the client sees, while the other agent's does not move. A request with a
different prefix goes to the other agent when the first one is busy, and its follow-ups then
stay there.

Nothing here waits on a clock: each step waits for a condition (a streamed token, a request's
response), so it holds on a loaded 2-core machine.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families
import httpx

pytestmark = pytest.mark.timeout(600)

BACKEND_HEADER = "x-slipstream-backend"
DOCUMENT_TOKENS = 640  # 40 engine blocks of 16, 10 router blocks of 64
HITS = "slipstream_prefix_cache_hit_tokens_total"


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(length)]


def metric_sum(base_url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` on an agent's ``/metrics`` that carry ``labels``."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v
                                              for k, v in labels.items()))


@pytest.fixture(scope="module")
def agents(start_server):
    # Unified: both serve every request class, so only load and prefixes pick between them.
    return {agent.base_url: agent for agent in (start_server(pool="unified"),
                                                start_server(pool="unified"))}


@pytest.fixture(scope="module")
def router(run_router, tiny_model_dir, tmp_path_factory, agents):
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-prefix"),
                    [f"{url}=unified" for url in agents]) as handle:
        yield handle


def complete(router, prompt: list[int], max_tokens: int = 4):
    """(the agent that served it, its cached prompt tokens)."""
    raw = router.client().completions.with_raw_response.create(
        model="tiny-test", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True})
    completion = raw.parse()
    return raw.headers[BACKEND_HEADER], completion.usage.prompt_tokens_details.cached_tokens


def hits(agents) -> dict[str, float]:
    return {url: metric_sum(url, HITS) for url in agents}


def test_follow_ups_sharing_a_long_prefix_land_on_the_agent_that_holds_it(router, agents):
    document = tokens(1, DOCUMENT_TOKENS)
    home, cached = complete(router, document + tokens(2, 20))
    assert cached == 0
    before = hits(agents)
    served = [complete(router, document + tokens(10 + turn, 20)) for turn in range(4)]
    assert [url for url, _ in served] == [home] * 4
    # Every follow-up found the whole document (40 full blocks) in the home agent's cache.
    assert [cached for _, cached in served] == [DOCUMENT_TOKENS] * 4
    after = hits(agents)
    assert after[home] - before[home] == 4 * DOCUMENT_TOKENS
    (other,) = set(agents) - {home}
    assert after[other] == before[other]  # nothing went there, so nothing hit there


def test_a_different_prefix_goes_to_the_idle_agent_and_its_follow_ups_stay_there(router, agents):
    # The decision under test needs the first agent busy while the new prefix is routed: a
    # stream is started there and must still be in flight after that request came back. On a
    # machine fast enough to finish the stream first, try again with fresh documents.
    for attempt in range(3):
        if _different_prefix_case(router, agents, seed=100 * (attempt + 1)):
            return
    pytest.fail("the busy agent's stream finished before the next request was routed, 3 times")


def _different_prefix_case(router, agents, seed: int) -> bool:
    """False when the premise (the first agent busy throughout) did not hold."""
    document_a, document_b = tokens(seed, DOCUMENT_TOKENS), tokens(seed + 1, DOCUMENT_TOKENS)
    home_a, _ = complete(router, document_a + tokens(seed + 2, 20))
    (other,) = set(agents) - {home_a}
    # Keep home_a busy: a long stream on document A, read up to its first token and then
    # left unread.
    stream = router.client().completions.with_raw_response.create(
        model="tiny-test", prompt=document_a + tokens(seed + 3, 20), max_tokens=1200,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    try:
        assert stream.headers[BACKEND_HEADER] == home_a
        chunks = iter(stream.parse())
        next(chunk for chunk in chunks if chunk.choices and chunk.choices[0].text)
        before = hits(agents)
        home_b, cached_b = complete(router, document_b + tokens(seed + 4, 20))
        # The stream was in flight before document B was routed; if it still is, home_a was
        # busy for the whole decision.
        if metric_sum(home_a, "slipstream_requests_in_flight", phase="decode") < 1:
            return False
        assert (home_b, cached_b) == (other, 0)
        # Follow-ups go home: B's to the other agent, A's to the busy one that holds A.
        assert complete(router, document_b + tokens(seed + 5, 20)) == (other, DOCUMENT_TOKENS)
        assert complete(router, document_a + tokens(seed + 6, 20)) == (home_a, DOCUMENT_TOKENS)
        after = hits(agents)
        assert after[other] - before[other] == DOCUMENT_TOKENS
        assert after[home_a] - before[home_a] == DOCUMENT_TOKENS
        return True
    finally:
        stream.http_response.close()
