"""KV-cache parallelism's arithmetic in one process: attention over each KVP group's shard
(``group_metadata``), merged by log-sum-exp, equals attention over the whole sequence, for
prefill chunks and decodes, whichever groups a sequence reaches."""

from __future__ import annotations

import torch

from slipstream.agent.parallel.kv_parallel import group_metadata
from slipstream.agent.scheduler.batch import ScheduledChunk
from slipstream.kernels.attention import merge_many
from slipstream.kernels.torch_ref import TorchReferenceBackend

BLOCK, HEADS, KV_HEADS, DIM = 16, 4, 2, 16
GROUP_TOKENS = 32
NUM_GROUPS = 4


def test_sharded_attention_merged_equals_whole():
    generator = torch.Generator().manual_seed(0)
    num_blocks = 40
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    tables = [tuple(range(0, 9)), tuple(range(9, 11)), tuple(range(11, 19))]
    # Two decodes (one deep in group 3, one still in group 0), then a prefill chunk that
    # starts in group 2 and sees groups 0-2.
    chunks = (ScheduledChunk("deep", (1,), 127, tables[0], True),
              ScheduledChunk("short", (1,), 20, tables[1], True),
              ScheduledChunk("chunk", tuple(range(20)), 70, tables[2], False))
    num_tokens = sum(c.num_tokens for c in chunks)
    query = torch.randn(num_tokens, HEADS, DIM, generator=generator)
    device = torch.device("cpu")

    whole = TorchReferenceBackend()
    whole.plan(group_metadata(chunks, 0, 1 << 30, BLOCK, device))
    expected = whole.run(query, k_cache, v_cache, 0.25).output

    parts = []
    for group in range(NUM_GROUPS):
        backend = TorchReferenceBackend()
        metadata = group_metadata(chunks, group, GROUP_TOKENS, BLOCK, device)
        # Only the owning group writes: every new token has a slot in exactly one group.
        assert metadata.kv_start_pos == (group * GROUP_TOKENS,) * 3
        backend.plan(metadata)
        parts.append(backend.run(query, k_cache, v_cache, 0.25))
    owners = torch.stack([group_metadata(chunks, g, GROUP_TOKENS, BLOCK, device).slot_mapping
                          >= 0 for g in range(NUM_GROUPS)])
    assert owners.sum(dim=0).tolist() == [1] * num_tokens
    merged = merge_many(parts).output
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)
