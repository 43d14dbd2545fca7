"""KV tiers through real HTTP and the official ``openai`` client, in the default layout (the
engine core in its own process): a document pushed off an 80-block device pool comes back from
the host tier, ``cached_tokens`` counts it, and the tier metrics move with it."""

from __future__ import annotations

import random

import pytest

from tests.server.conftest import SERVED_MODEL_NAME

pytestmark = pytest.mark.timeout(300)


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(length)]


def test_a_document_evicted_from_the_device_is_cached_in_the_host_tier(start_server):
    server = start_server("--num-kv-blocks", "80", "--kv-host-memory", "64MiB")
    client = server.openai_client(timeout=120)
    doc = tokens(3301, 1024)

    def ask(prompt):
        return client.completions.create(model=SERVED_MODEL_NAME, prompt=prompt, max_tokens=4,
                                         temperature=0, extra_body={"ignore_eos": True})

    first = ask(doc + [11, 12, 13])
    ask(tokens(3302, 1100))  # pushes most of the document off the device
    again = ask(doc + [11, 12, 13])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 1024
    assert again.choices[0].text == first.choices[0].text
    assert server.metric("slipstream_kv_tier_hit_tokens_total", tier="host") >= 512
    assert server.metric("slipstream_kv_tier_blocks_capacity", tier="host") > 0
    assert server.metric("slipstream_kv_tier_bytes_total", direction="host_to_device") > 0
