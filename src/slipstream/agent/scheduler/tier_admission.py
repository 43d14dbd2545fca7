"""The request side of KV tiers (kv_tiers.py holds the tiers' index): lookups over every
tier, requests held while their prefix comes up from disk, and loads at admission.

    Scheduler.add --lookup_prefix()--> prefix_hit_tokens (all tiers), prefix_load_s,
                                       disk blocks to fetch --> FetchHold until they are up
    Scheduler._pack_prefills --host_prefix()--> blocks to load, priced by the packer
                             --load_host_prefix()--> new device blocks, Batch.kv_load copies

The scheduler calls these; the order of requests and the batch budget stay there.
"""

from __future__ import annotations

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.kv_tiers import KVTiers
from slipstream.agent.scheduler.request import Request


def lookup_prefix(manager: BlockManager, request: Request) -> tuple[list[bytes], list[bytes]]:
    """Set the request's cached prefix over every tier (``prefix_hit_tokens``) and the time
    to bring its lower-tier part onto the device (``prefix_load_s``); returns the hashes of
    the blocks past the device's that the host holds, then of those only the disk holds,
    which must come up to the host before they can load."""
    block_size = manager.block_size
    hashes = request.block_hashes
    device = len(manager.match_prefix(hashes, request.num_tokens))
    host_run, disk_run = manager.match_lower_tiers(hashes, device, request.num_tokens)
    request.prefix_hit_tokens = (device + host_run + disk_run) * block_size
    tiers = manager.tiers
    if tiers is None:
        request.prefix_load_s = 0.0
        return [], []
    request.prefix_load_s = (tiers.config.load_ms(host_run + disk_run) / 1000.0
                             + tiers.config.fetch_s(disk_run))
    start = device + host_run
    found_host, found_disk = hashes[device:start], hashes[start:start + disk_run]
    tiers.touch_found(found_host, found_disk)
    return found_host, found_disk


def host_prefix(manager: BlockManager, request: Request, device_blocks: int) -> list[bytes]:
    """Hashes of the blocks past the device's ``device_blocks`` that the host holds in a
    row: the part of the prefix admission would load instead of computing."""
    host_run, _ = manager.match_lower_tiers(request.block_hashes, device_blocks,
                                            request.num_tokens)
    return request.block_hashes[device_blocks:device_blocks + host_run]


def load_host_prefix(manager: BlockManager, request: Request, hashes: list[bytes],
                     first_admission: bool) -> None:
    """Give the request new device blocks for these host blocks, loaded before this batch's
    forward, as computed and cached blocks (call it right after ``take_prefix``)."""
    tiers = manager.tiers
    assert tiers is not None and hashes
    tiers.hold_for_load(hashes)  # the allocation below may push device blocks to the host
    blocks = manager.device.allocate(len(hashes))
    from_disk = tiers.plan_load(hashes, blocks)
    for block, block_hash in zip(blocks, hashes):
        manager.device.register(block, block_hash)
    manager.device.note_reused(blocks)
    request.block_ids.extend(blocks)
    request.num_computed_tokens += len(blocks) * manager.block_size
    request.num_registered_blocks = len(request.block_ids)
    request.prefix_hit_tokens = request.num_computed_tokens
    if first_admission:
        manager.prefix_hit_tokens_host += (len(blocks) - from_disk) * manager.block_size
        manager.prefix_hit_tokens_disk += from_disk * manager.block_size


class FetchHold:
    """Requests waiting for blocks of their prefix to come up from the disk tier; each is
    released to the queue once none of its blocks is still being fetched (fetched or
    failed: a failed block is simply computed). While a request waits, the part of its
    prefix the host holds already is pinned there, so its own fetches cannot evict it."""

    def __init__(self, tiers: KVTiers | None) -> None:
        self.tiers = tiers
        self._held: dict[str, tuple[Request, list[bytes], list[bytes]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._held

    def hold(self, request: Request, host_hashes: list[bytes], disk_hashes: list[bytes]) -> bool:
        """Start the fetches and hold the request; False (nothing held) when none started."""
        tiers = self.tiers
        if tiers is None or not disk_hashes:
            return False
        for block_hash in host_hashes:
            tiers.host.pin(block_hash)
        started = tiers.fetch(disk_hashes)
        if not started:
            self._unpin(host_hashes)
            return False
        self._held[request.request_id] = (request, host_hashes, started)
        return True

    def remove(self, request: Request) -> None:
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self._unpin(held[1])

    def release(self) -> list[Request]:
        tiers = self.tiers
        if tiers is None:
            return []
        ready = [request for request, _, fetching in self._held.values()
                 if not any(tiers.is_fetching(block_hash) for block_hash in fetching)]
        for request in ready:
            self.remove(request)
        return ready

    def _unpin(self, host_hashes: list[bytes]) -> None:
        assert self.tiers is not None
        for block_hash in host_hashes:
            if block_hash in self.tiers.host:
                self.tiers.host.unpin(block_hash)
