"""KV transports move exactly the blocks asked for, between two sets of KV tensors.

The holder side registers its tensors and serves a side channel; the reader pulls blocks
into different block ids of its own tensors. Mooncake runs its real TCP transport here.
"""

from __future__ import annotations

import importlib.util
import platform
import sys

import pytest
import torch

from slipstream.agent.engine.kv.transfer.layout import KVLayout, regions_of
from slipstream.agent.engine.kv.transfer.side_channel import SideChannelClient, SideChannelServer
from slipstream.agent.engine.kv.transfer.transport import (
    KVHandle, KVTransferError, make_transport, prompt_digest)

MOONCAKE_WHEEL = sys.platform == "linux" and platform.machine() == "x86_64"
# `make test` installs the Mooncake wheel (the kv-transfer extra); a machine without it (a
# GPU host running the engine tier from a bare image) skips, saying so.
MOONCAKE_INSTALLED = importlib.util.find_spec("mooncake") is not None
TRANSPORTS = [
    pytest.param("mooncake", marks=pytest.mark.skipif(
        not (MOONCAKE_WHEEL and MOONCAKE_INSTALLED),
        reason="the mooncake module is not installed (pip install -e '.[kv-transfer]'); "
               "Mooncake publishes Linux x86-64 wheels only")),
    "zmq",
]


def _caches(num_blocks: int, seed: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 16, 2, 8)
    return [(torch.randn(shape, generator=generator).to(dtype),
             torch.randn(shape, generator=generator).to(dtype)) for _ in range(3)]


class _Holder:
    def __init__(self, transport: str, caches, held: dict[str, tuple[int, ...]]) -> None:
        self.layout = KVLayout.of(caches)
        regions = regions_of(caches)
        self.held = held
        self.released: list[str] = []
        self.transport = make_transport(transport, self.layout, regions, "127.0.0.1")
        self.server = SideChannelServer("127.0.0.1", 0, held.get, self._release,
                                        regions if transport == "zmq" else None)

    def _release(self, transfer_id: str) -> bool:
        self.released.append(transfer_id)
        return self.held.pop(transfer_id, None) is not None

    def handle(self, transfer_id: str, block_ids: tuple[int, ...]) -> KVHandle:
        return KVHandle(transfer_id, self.transport.name, self.server.address,
                        self.transport.endpoint, self.transport.region_addrs(), self.layout,
                        block_ids, len(block_ids) * 16, prompt_digest([1]), 7)

    def close(self) -> None:
        self.server.close()
        self.transport.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_arrive_bit_exact_in_the_blocks_asked_for(transport, dtype):
    source, target = _caches(10, seed=1, dtype=dtype), _caches(12, seed=2, dtype=dtype)
    before = [(k.clone(), v.clone()) for k, v in target]
    remote, local = [3, 4, 5, 8], [0, 1, 2, 9]  # one run of three, then a lone block
    holder = _Holder(transport, source, {"t1": tuple(remote)})
    client = SideChannelClient(timeout_s=10)
    reader = make_transport(transport, KVLayout.of(target), regions_of(target), "127.0.0.1",
                            side_channel=client)
    try:
        handle = holder.handle("t1", tuple(remote))
        reader.read_blocks(handle, remote[:2], local[:2])  # in two reads, as the engine does
        reader.read_blocks(handle, remote[2:], local[2:])
        for (src_k, src_v), (dst_k, dst_v), (old_k, old_v) in zip(source, target, before):
            for r, l in zip(remote, local):
                assert torch.equal(dst_k[l], src_k[r]) and torch.equal(dst_v[l], src_v[r])
            untouched = [b for b in range(12) if b not in local]
            assert torch.equal(dst_k[untouched], old_k[untouched])
            assert torch.equal(dst_v[untouched], old_v[untouched])
        client.request(holder.server.address, ["release", "t1"])
        assert holder.released == ["t1"] and not holder.held
    finally:
        reader.close()
        holder.close()


def test_zmq_holder_serves_only_blocks_held_under_the_transfer():
    source, target = _caches(6, seed=3), _caches(6, seed=4)
    holder = _Holder("zmq", source, {"t1": (1, 2)})
    client = SideChannelClient(timeout_s=10)
    reader = make_transport("zmq", KVLayout.of(target), regions_of(target), "127.0.0.1",
                            side_channel=client)
    try:
        with pytest.raises(KVTransferError, match="not held"):
            reader.read_blocks(holder.handle("t1", (1, 2)), [3], [0])
        with pytest.raises(KVTransferError, match="no KV held"):
            reader.read_blocks(holder.handle("gone", (1,)), [1], [0])
    finally:
        reader.close()
        holder.close()


def test_a_silent_holder_times_out_with_a_clear_error():
    client = SideChannelClient(timeout_s=0.3)
    try:
        # Nothing listens on this port: the request is queued, and the reply never comes.
        with pytest.raises(KVTransferError, match="did not answer within"):
            client.request("tcp://127.0.0.1:9", ["release", "x"])
    finally:
        client.close()


def test_layout_mismatch_is_refused_before_any_transfer():
    source, target = _caches(4, seed=5), _caches(4, seed=6, dtype=torch.bfloat16)
    holder = _Holder("zmq", source, {"t1": (0,)})
    reader = make_transport("zmq", KVLayout.of(target), regions_of(target), "127.0.0.1",
                            side_channel=SideChannelClient(timeout_s=5))
    try:
        with pytest.raises(KVTransferError, match="same model with the same dtype"):
            reader.read_blocks(holder.handle("t1", (0,)), [0], [0])
    finally:
        reader.close()
        holder.close()


def test_handle_round_trips_through_json_and_rejects_bad_fields():
    layout = KVLayout(2, 16, 2, 8, "float32")
    handle = KVHandle("t", "zmq", "tcp://127.0.0.1:1", "", (), layout, (4, 5), 20,
                      prompt_digest([1, 2]), 3)
    assert KVHandle.from_json(handle.to_json()) == handle
    with pytest.raises(ValueError, match="missing 'layout'"):
        KVHandle.from_json({k: v for k, v in handle.to_json().items() if k != "layout"})
    with pytest.raises(ValueError, match="need 2"):
        KVHandle.from_json({**handle.to_json(), "block_ids": [1]})
    with pytest.raises(ValueError, match="transport must be one of"):
        KVHandle.from_json({**handle.to_json(), "transport": "carrier-pigeon"})
    with pytest.raises(ValueError, match="first_token_id must be >= 0"):
        KVHandle.from_json({**handle.to_json(), "first_token_id": -1})


def test_a_streaming_handle_round_trips_and_carries_no_blocks():
    layout = KVLayout(2, 16, 2, 8, "float32")
    handle = KVHandle("t", "zmq", "tcp://127.0.0.1:1", "", (), layout, (), 20,
                      prompt_digest([1, 2]), -1, streaming=True)
    raw = handle.to_json()
    assert raw["streaming"] is True and raw["block_ids"] == []
    assert KVHandle.from_json(raw) == handle
    with pytest.raises(ValueError, match="carries no block_ids"):
        KVHandle.from_json({**raw, "block_ids": [4, 5]})
    # A complete handle from an older prefill instance has no "streaming" field.
    complete = {**raw, "streaming": None, "block_ids": [4, 5], "first_token_id": 3}
    del complete["streaming"]
    assert KVHandle.from_json(complete).streaming is False
