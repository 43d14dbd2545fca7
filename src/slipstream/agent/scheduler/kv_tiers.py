"""KV tiers under the block manager: what the host-memory and disk tiers hold, by block hash.

    device pool (BlockPool, LRU of cached free blocks)
        --evicts block b holding hash h--> host tier (LRU)  --evicts h'--> disk tier (LRU)
    a new request's prefix, past what the device holds:
        host hit  -> load: host slot -> a new device block, before the forward
                     (Batch.tier_ops.load)
        disk hit  -> fetch: disk slot -> host slot, in the background (Batch.tier_ops.fetch);
                     the request is held until its fetches report back, then loads from the
                     host

Pure Python, like the block manager: this is the index of the lower tiers, keyed by the same
chained block hashes; the engine's ``KVTierStore`` (agent/engine/kv/tier_store.py) owns the
bytes and executes the copies a batch lists (``TierOps``), in this order: ``spill`` (host ->
disk, the host slot is read at once), ``offload`` (device -> host), then the batch's
swap-ins, then ``fetch`` starts (disk -> host, asynchronous), then ``load`` (host -> device).
Within a batch, the slots a load reads and the slots an offload fills are pinned while the
batch is planned, so no offload of the same batch overwrites the first, and no spill of the
same batch (which runs before the offloads) reads the second; the host slot a fetch writes
is pinned until the fetch reports, so it is never a load's.

The host tier is exclusive of the device by default (``KVTierConfig.exclusive_host``): a block
loaded back to the device leaves the host tier once the batch is cut, so the two hold
``device + host`` blocks between them, not ``max(device, host)``; the device copies it down
again when it evicts it. (On the Mooncake trace with a 1 TiB host tier the inclusive host
found 0.865 of the unbounded bound and the exclusive one 0.877, docs/kv-tiers.md.) The disk
tier is inclusive: a block the host evicts is written only if the disk does not hold it yet.
The host tier is a segmented LRU (tier_index.py): blocks that were reused since they were
computed are kept ahead of blocks that never were, within ``host_protected_fraction`` of its
slots; the disk tier is a plain LRU. A block is touched when it is found.

Nothing here fails a request. A tier with no free slot (every slot pinned) drops the block;
a fetch or a spill that fails (``TierResults``) drops the hash, and a request waiting for it
computes those tokens instead.

Cost: a lower-tier hit is a load, priced at ``bytes / bandwidth`` (``load_ms``), which the
urgency model and the packer add to the work and the batch time of the request that loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from slipstream.agent.scheduler.tier_index import TierIndex

__all__ = ["KVTierConfig", "KVTiers", "TierCopy", "TierIndex", "TierOps", "TierResults"]

HOST = "host"
DISK = "disk"
TIER_NAMES = ("device", HOST, DISK)


@dataclass(frozen=True)
class KVTierConfig:
    """Sizes of the lower tiers in blocks and their bandwidths for pricing loads.

    ``host_load_gb_per_s`` is host -> device (PCIe on a GPU; a memory copy on a CPU) and
    ``disk_read_gb_per_s`` is disk -> host; both come from the runtime profile where it
    measured them, else from the defaults below (an H100 node: PCIe 5 x16, one NVMe)."""

    host_blocks: int = 0
    disk_blocks: int = 0
    bytes_per_block: int = 0
    host_load_gb_per_s: float = 25.0
    disk_read_gb_per_s: float = 5.0
    # A block loaded back to the device leaves the host tier (see the module docstring).
    exclusive_host: bool = True
    # Share of the host tier kept for blocks that were reused (tier_index.py); 0: plain LRU.
    host_protected_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ValueError("tier sizes must be >= 0 blocks")
        if self.disk_blocks and not self.host_blocks:
            raise ValueError("a disk tier needs a host tier: disk blocks are staged through "
                             "host memory (give --kv-host-memory too)")
        if self.enabled and self.bytes_per_block <= 0:
            raise ValueError("bytes_per_block must be > 0 when a tier is on")
        if self.host_load_gb_per_s <= 0 or self.disk_read_gb_per_s <= 0:
            raise ValueError("tier bandwidths must be > 0")
        if not 0.0 <= self.host_protected_fraction < 1.0:
            raise ValueError("host_protected_fraction must be in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.host_blocks > 0

    def load_ms(self, num_blocks: int) -> float:
        """Host -> device for ``num_blocks`` blocks."""
        return num_blocks * self.bytes_per_block / (self.host_load_gb_per_s * 1e6)

    def fetch_s(self, num_blocks: int) -> float:
        """Disk -> host for ``num_blocks`` blocks."""
        return num_blocks * self.bytes_per_block / (self.disk_read_gb_per_s * 1e9)


@dataclass(frozen=True, slots=True)
class TierCopy:
    """One block moved between tiers: ``src`` and ``dst`` are a device block id or a tier
    slot, as the list that carries it says. ``block_hash`` names the block (the disk tier
    writes it into the file and checks it on read)."""

    src: int
    dst: int
    block_hash: bytes


@dataclass
class TierOps:
    """The copies one batch carries (see the module docstring for their order)."""

    spill: list[TierCopy] = field(default_factory=list)  # host slot -> disk slot
    offload: list[TierCopy] = field(default_factory=list)  # device block -> host slot
    load: list[TierCopy] = field(default_factory=list)  # host slot -> device block
    fetch: list[TierCopy] = field(default_factory=list)  # disk slot -> host slot

    def __bool__(self) -> bool:
        return bool(self.spill or self.offload or self.load or self.fetch)


@dataclass(frozen=True)
class TierResults:
    """What the store reports back: fetches done (host slot now valid) or failed (corrupt,
    missing, I/O error), and spills that failed (the disk does not hold the block)."""

    fetched: tuple[bytes, ...] = ()
    fetch_failed: tuple[bytes, ...] = ()
    spill_failed: tuple[bytes, ...] = ()
    offload_failed: tuple[bytes, ...] = ()  # device -> host copies that did not land


class KVTiers:
    """The host and disk tiers' index, the copies they ask for, and their counters."""

    def __init__(self, config: KVTierConfig) -> None:
        self.config = config
        self.host = TierIndex(HOST, config.host_blocks, config.host_protected_fraction)
        self.disk = TierIndex(DISK, config.disk_blocks) if config.disk_blocks else None
        self.ops = TierOps()
        self._fetching: set[bytes] = set()  # disk -> host in flight (host slot pinned)
        self._from_disk: set[bytes] = set()  # fetched to host, not yet loaded: disk hits
        self._planning_pins: list[bytes] = []  # host hashes pinned until the batch is cut
        self._loaded: list[bytes] = []  # loaded this batch: leave the host once it is cut
        # Counters (cumulative): hit tokens by tier are kept by the block manager.
        self.offloaded_blocks = 0
        self.spilled_blocks = 0
        self.loaded_blocks = 0
        self.fetched_blocks = 0
        self.failed_blocks = 0
        self.dropped_blocks = 0  # a tier had no free slot (every slot pinned)

    # -- down: evictions ----------------------------------------------------------------

    def on_device_evict(self, block: int, block_hash: bytes, reused: bool = False) -> None:
        """The device pool evicts ``block``: keep its KV in the host tier (``reused``: it
        was found in a cache since it was computed, tier_index.py)."""
        host = self.host
        if block_hash in host:
            host.touch(block_hash)
            return
        if block_hash in self._fetching:
            return  # its host slot is being filled from disk already
        placed = host.insert(block_hash, reused)
        if placed is None:
            self.dropped_blocks += 1
            return
        slot, evicted = placed
        if evicted is not None:
            self._spill(slot, evicted)
        self.ops.offload.append(TierCopy(block, slot, block_hash))
        self.offloaded_blocks += 1
        # Until the batch is cut: a later eviction of the same batch must not pick this slot,
        # whose spill would run before this offload fills it.
        self.host.pin(block_hash)
        self._planning_pins.append(block_hash)

    def _spill(self, host_slot: int, block_hash: bytes) -> None:
        """The host evicts ``block_hash`` from ``host_slot``: keep it on disk, if any."""
        self._from_disk.discard(block_hash)
        disk = self.disk
        if disk is None:
            return
        if block_hash in disk:
            disk.touch(block_hash)
            return
        placed = disk.insert(block_hash)
        if placed is None:
            self.dropped_blocks += 1
            return
        self.ops.spill.append(TierCopy(host_slot, placed[0], block_hash))
        self.spilled_blocks += 1

    # -- up: lookups, loads and fetches -----------------------------------------------------

    def match(self, hashes: Sequence[bytes], start: int, max_blocks: int) -> tuple[int, int]:
        """From block ``start`` on: how many blocks the host holds in a row, then how many
        after those only the disk holds (a block on its way from disk counts as disk)."""
        host, disk = self.host, self.disk
        index = start
        end = min(len(hashes), max_blocks)
        while index < end and hashes[index] in host and hashes[index] not in self._fetching:
            index += 1
        host_run = index - start
        if disk is not None:  # on disk only, or on its way up to the host already
            fetching = self._fetching
            while index < end and hashes[index] in disk and (
                    hashes[index] not in host or hashes[index] in fetching):
                index += 1
        return host_run, index - start - host_run

    def fetch(self, hashes: Iterable[bytes]) -> list[bytes]:
        """Start bringing these disk blocks to the host; returns those now in flight (a
        block already in flight is included, one the host has no slot for is not)."""
        disk = self.disk
        started: list[bytes] = []
        if disk is None:
            return started
        for block_hash in hashes:
            if block_hash in self._fetching:
                started.append(block_hash)
                continue
            disk_slot = disk.slot(block_hash)
            if disk_slot is None or block_hash in self.host:
                continue
            # Pinned first: its file must not be overwritten while it is read, and the spill
            # that making room in the host may cause must not evict it from the disk.
            disk.touch(block_hash)
            disk.pin(block_hash)
            placed = self.host.insert(block_hash, reused=True)  # fetched to be loaded
            if placed is None:
                disk.unpin(block_hash)
                self.dropped_blocks += 1
                break
            slot, evicted = placed
            if evicted is not None:
                self._spill(slot, evicted)
            self.host.pin(block_hash)
            self._fetching.add(block_hash)
            self.ops.fetch.append(TierCopy(disk_slot, slot, block_hash))
            started.append(block_hash)
        return started

    def touch_found(self, host_hashes: Sequence[bytes], disk_hashes: Sequence[bytes]) -> None:
        """A new request found these blocks: they are the newest in their tiers now, so the
        evictions made while it waits in the queue take other blocks first."""
        host, disk = self.host, self.disk
        for block_hash in reversed(host_hashes):  # the prefix's head ends up newest
            host.touch(block_hash)
        if disk is not None:
            for block_hash in reversed(disk_hashes):
                disk.touch(block_hash)

    def is_fetching(self, block_hash: bytes) -> bool:
        return block_hash in self._fetching

    def hold_for_load(self, hashes: Sequence[bytes]) -> None:
        """Pin these host blocks until the batch is cut, before device blocks are allocated
        for them (an allocation evicts device blocks into the host, which must not evict
        these)."""
        host = self.host
        for block_hash in hashes:
            host.touch(block_hash)
            host.pin(block_hash)
            self._planning_pins.append(block_hash)

    def plan_load(self, hashes: Sequence[bytes], device_blocks: Sequence[int]) -> int:
        """Load these host blocks (held by ``hold_for_load``) into these new device blocks;
        returns how many of them came from disk (their fetch brought them up for this)."""
        from_disk = 0
        host = self.host
        for block_hash, block in zip(hashes, device_blocks):
            slot = host.slot(block_hash)
            assert slot is not None, "plan_load takes blocks match() found in the host"
            self.ops.load.append(TierCopy(slot, block, block_hash))
            self._loaded.append(block_hash)
            if block_hash in self._from_disk:
                self._from_disk.discard(block_hash)
                from_disk += 1
        self.loaded_blocks += len(device_blocks)
        return from_disk

    def take_ops(self) -> TierOps:
        """The copies planned since the last call, for the next batch; the host slots its
        loads read stay unpinned from now on (the store runs the batch's copies in order)."""
        ops, self.ops = self.ops, TierOps()
        host = self.host
        for block_hash in self._planning_pins:
            host.unpin(block_hash)
        self._planning_pins.clear()
        if self.config.exclusive_host:
            # The device holds these now; a slot another request still pins stays (it is
            # about to load from it, or waits for its fetch beside it).
            for block_hash in self._loaded:
                if block_hash in host and not host.is_pinned(block_hash):
                    host.remove(block_hash)
        self._loaded.clear()
        return ops

    def apply_results(self, results: TierResults) -> list[bytes]:
        """Take the store's report; returns the hashes whose fetch ended (either way)."""
        ended: list[bytes] = []
        disk = self.disk
        for block_hash in results.fetched:
            if block_hash in self._fetching:
                self._fetching.discard(block_hash)
                self.host.unpin(block_hash)
                if disk is not None:
                    disk.unpin(block_hash)
                self._from_disk.add(block_hash)
                self.fetched_blocks += 1
                ended.append(block_hash)
        for block_hash in results.fetch_failed:
            if block_hash in self._fetching:
                self._fetching.discard(block_hash)
                self.host.remove(block_hash)
                ended.append(block_hash)
            if disk is not None:
                disk.remove(block_hash)  # corrupt or unreadable: never served
            self.failed_blocks += 1
        for block_hash in results.spill_failed:
            if disk is not None and block_hash not in self._fetching:
                disk.remove(block_hash)
            self.failed_blocks += 1
        for block_hash in results.offload_failed:
            self.host.remove(block_hash)  # its slot holds something else
            self.failed_blocks += 1
        return ended

    # -- occupancy ------------------------------------------------------------------------------

    @property
    def host_blocks_used(self) -> int:
        return len(self.host)

    @property
    def disk_blocks_used(self) -> int:
        return len(self.disk) if self.disk is not None else 0

    @property
    def capacity_blocks(self) -> int:
        return self.config.host_blocks + self.config.disk_blocks
