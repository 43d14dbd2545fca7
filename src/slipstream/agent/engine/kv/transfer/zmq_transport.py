"""The fallback transport: KV bytes travel over the holder's ZeroMQ side channel.

No registration and nothing beyond pyzmq; every byte is copied through the sockets, so it
is slower than a transfer engine that reads remote memory directly (Mooncake over TCP or
RDMA). ``make bench-pd`` measures both.
"""

from __future__ import annotations

import torch

from slipstream.agent.engine.kv.transfer.layout import KVLayout
from slipstream.agent.engine.kv.transfer.mooncake import merge_runs
from slipstream.agent.engine.kv.transfer.side_channel import SideChannelClient
from slipstream.agent.engine.kv.transfer.transport import KVHandle, KVTransferError, KVTransport


class ZmqTransport(KVTransport):
    name = "zmq"

    def __init__(self, layout: KVLayout, regions: list[torch.Tensor],
                 client: SideChannelClient | None = None) -> None:
        super().__init__(layout, regions)
        self._client = client or SideChannelClient()

    @property
    def endpoint(self) -> str:
        return ""

    def region_addrs(self) -> tuple[int, ...]:
        return ()

    def read_blocks(self, handle: KVHandle, remote_block_ids: list[int],
                    local_block_ids: list[int]) -> None:
        self.check_compatible(handle)
        frames = self._client.request(handle.side_channel,
                                      ["read", handle.transfer_id, list(remote_block_ids)])
        # The holder merged runs of its own block ids; split them by runs of both sides.
        blocks: dict[int, list[torch.Tensor]] = {}
        index = 0
        for start, _, count in merge_runs(list(remote_block_ids), list(remote_block_ids)):
            for region in self.regions:
                if index >= len(frames):
                    raise KVTransferError("the prefill instance sent fewer KV frames than asked")
                raw = torch.frombuffer(bytearray(frames[index]), dtype=torch.uint8)
                index += 1
                per_block = raw.view(count, -1)
                for offset in range(count):
                    blocks.setdefault(start + offset, []).append(per_block[offset])
        for remote, local in zip(remote_block_ids, local_block_ids):
            for region, data in zip(self.regions, blocks[remote]):
                region[local].view(torch.uint8).view(-1).copy_(data.to(region.device))

    def close(self) -> None:
        self._client.close()
