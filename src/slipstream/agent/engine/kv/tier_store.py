"""The bytes of the KV tiers: a host-memory pool (pinned on CUDA) and a disk directory.

    Batch.tier_ops (planned by the scheduler's KVTiers, agent/scheduler/kv_tiers.py)
        ModelRunner.execute:  swap-outs
                              store.before_swap_in:  spills (host slot read now, written to
                                                     disk by the I/O thread), offloads
                                                     (device -> host)
                              swap-ins
                              store.after_swap_in:   fetches handed to the I/O thread
                                                     (disk -> host), then loads (host -> device)
                              forward
        LLMEngine.step: store.poll() -> TierResults -> Scheduler.apply_tier_results

The host pool has the device pool's layout, ``[slots, 16, kv_heads, head_dim]`` per layer for
K and V, so a copy is one indexed copy per layer and tensor. On CUDA the pool is pinned so
the copies run at PCIe speed; on a CPU they are memory copies.

Disk format (one file per disk slot, ``slot-00000042.kvb``, rewritten whole by ``os.replace``
so a reader never sees half a block):

    header (48 bytes, little-endian): magic b"SKV1", format version u16 (1), reserved u16,
        payload bytes u64, block hash (16 bytes, the chained hash of block_manager.py),
        checksum (16 bytes, BLAKE2b-128 of the payload)
    payload: the block's K and V for every layer, ``[layers, 2, 16, kv_heads, head_dim]`` in
        the model's KV dtype, C order

A read checks the magic, the version, the length, the block hash it expects and the
checksum; any mismatch (or an I/O error) reports the block as failed, and the scheduler drops
it and computes those tokens. A failed write is reported the same way. The index of what the
disk holds lives in the scheduler and starts empty: files left by an earlier run are
overwritten, never read.

All disk work runs on one I/O thread, reads before writes: a follow-up waiting for its prefix
does not queue behind the spills of the prompts that pushed it out. A write waiting its turn
stays in memory, and a read of that slot takes it from there, so a fetch always sees the
block the index says the slot holds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from slipstream.agent.engine.errors import KVTierLoadError
from slipstream.agent.scheduler.kv_tiers import TierCopy, TierOps, TierResults

log = logging.getLogger(__name__)

MAGIC = b"SKV1"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQ16s16s")
CHECKSUM_BYTES = 16

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


class CorruptBlock(Exception):
    """A disk block that does not check out: it is dropped, never served."""


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES).digest()


class DiskTier:
    """Blocks in files under ``path``, one per slot (format in the module docstring)."""

    def __init__(self, path: Path, num_blocks: int, payload_bytes: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.num_blocks = num_blocks
        self.payload_bytes = payload_bytes

    @staticmethod
    def blocks_for(size_bytes: int, payload_bytes: int) -> int:
        return size_bytes // (payload_bytes + HEADER.size)

    def file(self, slot: int) -> Path:
        return self.path / f"slot-{slot:08d}.kvb"

    def write(self, slot: int, block_hash: bytes, payload: bytes) -> None:
        header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(payload), block_hash, checksum(payload))
        handle, temporary = tempfile.mkstemp(dir=self.path, prefix=".write-")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(header)
                out.write(payload)
            os.replace(temporary, self.file(slot))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def read(self, slot: int, block_hash: bytes) -> bytes:
        with open(self.file(slot), "rb") as source:
            data = source.read()
        if len(data) < HEADER.size:
            raise CorruptBlock(f"slot {slot}: {len(data)} bytes, shorter than a header")
        magic, version, _, length, stored_hash, stored_sum = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size:]
        if magic != MAGIC or version != FORMAT_VERSION:
            raise CorruptBlock(f"slot {slot}: not a version-{FORMAT_VERSION} KV block file")
        if length != self.payload_bytes or len(payload) != length:
            raise CorruptBlock(f"slot {slot}: {len(payload)} payload bytes, expected "
                               f"{self.payload_bytes}")
        if stored_hash != block_hash:
            raise CorruptBlock(f"slot {slot} holds another block")
        if checksum(payload) != stored_sum:
            raise CorruptBlock(f"slot {slot}: checksum mismatch")
        return bytes(payload)


class KVTierStore:
    def __init__(self, layer_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype,
                 device: torch.device, host_blocks: int, disk: DiskTier | None) -> None:
        self.device = device
        self.dtype = dtype
        self.block_shape = (num_layers, 2, *layer_shape[1:])
        pin = device.type == "cuda"
        shape = (host_blocks, *layer_shape[1:])
        # Uninitialised: a slot is always written (offload, fetch) before it is read, and a
        # large pinned pool would take minutes to zero.
        self.host: KVLayers = [(torch.empty(shape, dtype=dtype, pin_memory=pin),
                                torch.empty(shape, dtype=dtype, pin_memory=pin))
                               for _ in range(num_layers)]
        self.disk = disk
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._reads: deque[TierCopy] = deque()
        self._writes: deque[tuple[TierCopy, bytes]] = deque()
        self._barriers: list[tuple[int, threading.Event]] = []  # drain(): (ticket, done)
        self._queued = self._done = 0
        self._pending_writes: dict[int, tuple[bytes, bytes]] = {}  # disk slot -> (hash, payload)
        self._closed = False
        self._thread: threading.Thread | None = None
        if disk is not None:
            self._thread = threading.Thread(target=self._run_io, name="kv-tier-io", daemon=True)
            self._thread.start()
        self._fetched: list[bytes] = []
        self._fetch_failed: list[bytes] = []
        self._spill_failed: list[bytes] = []
        self._offload_failed: list[bytes] = []
        # Cumulative counters (metrics): bytes each way, and seconds spent loading.
        self.bytes_offloaded = 0  # device -> host
        self.bytes_loaded = 0  # host -> device
        self.bytes_spilled = 0  # host -> disk
        self.bytes_fetched = 0  # disk -> host
        self.load_seconds = 0.0
        self.fetch_seconds = 0.0

    @property
    def bytes_per_block(self) -> int:
        count = 1
        for size in self.block_shape:
            count *= size
        return count * (torch.finfo(self.dtype).bits // 8)

    # -- one batch's copies ---------------------------------------------------------------------

    def before_swap_in(self, ops: TierOps, device_kv: KVLayers) -> None:
        """Spills, then offloads. A copy that fails is reported (``poll``), and the scheduler
        forgets the block in that tier: nothing here fails the batch."""
        if ops.spill and self.disk is not None:
            for copy in ops.spill:
                try:
                    payload = self._payload(copy.src)  # now: an offload may reuse the slot
                except Exception as error:  # noqa: BLE001 - the block is just not kept
                    log.warning("KV host tier: reading a block to spill failed (%s)", error)
                    with self._lock:
                        self._spill_failed.append(copy.block_hash)
                    continue
                self._submit(lambda: self._writes.append((copy, payload)), copy.dst, payload,
                             copy.block_hash)
        if ops.offload:
            try:
                self._copy(device_kv, self.host, ops.offload)
            except Exception as error:  # noqa: BLE001 - the blocks are just not kept
                log.warning("KV host tier: offloading %d blocks failed (%s); they are not "
                            "kept", len(ops.offload), error)
                with self._lock:
                    self._offload_failed.extend(copy.block_hash for copy in ops.offload)
                return
            self.bytes_offloaded += len(ops.offload) * self.bytes_per_block

    def after_swap_in(self, ops: TierOps, device_kv: KVLayers) -> None:
        """Fetches handed to the I/O thread (their slots are pinned, none is a load's), then
        loads. A failed load raises ``KVTierLoadError`` naming the device blocks: the engine
        recomputes their requests."""
        for fetch in ops.fetch:
            self._submit(lambda: self._reads.append(fetch))
        if ops.load:
            started = time.perf_counter()
            try:
                self._copy(self.host, device_kv, ops.load)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            except Exception as error:
                raise KVTierLoadError(tuple(copy.dst for copy in ops.load), error) from error
            finally:
                self.load_seconds += time.perf_counter() - started
            self.bytes_loaded += len(ops.load) * self.bytes_per_block

    def poll(self) -> TierResults:
        """Fetches that ended and spills that failed since the last poll."""
        with self._lock:
            if not (self._fetched or self._fetch_failed or self._spill_failed
                    or self._offload_failed):
                return TierResults()
            results = TierResults(tuple(self._fetched), tuple(self._fetch_failed),
                                  tuple(self._spill_failed), tuple(self._offload_failed))
            self._fetched, self._fetch_failed, self._spill_failed = [], [], []
            self._offload_failed = []
        return results

    def drain(self) -> None:
        """Wait until every disk read and write queued so far has run."""
        if self._thread is None:
            return
        done = threading.Event()
        with self._work:
            if self._done >= self._queued:
                return
            self._barriers.append((self._queued, done))
        done.wait()

    def close(self) -> None:
        with self._work:
            self._closed = True
            self._work.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the I/O thread ---------------------------------------------------------------------------

    def _submit(self, enqueue: Callable[[], None], slot: int | None = None,
                payload: bytes | None = None, block_hash: bytes | None = None) -> None:
        with self._work:
            enqueue()
            if slot is not None and payload is not None and block_hash is not None:
                self._pending_writes[slot] = (block_hash, payload)
            self._queued += 1
            self._work.notify()

    def _run_io(self) -> None:
        while True:
            with self._work:
                while not (self._reads or self._writes or self._closed):
                    self._work.wait()
                if self._reads:
                    read: TierCopy | None = self._reads.popleft()
                    write = None
                elif self._writes:
                    read, write = None, self._writes.popleft()
                else:
                    return  # closed, nothing left
            if read is not None:
                self._fetch(read)
            elif write is not None:
                self._spill(*write)
            with self._work:
                self._done += 1
                if write is not None and self._pending_writes.get(write[0].dst, (b"", b""))[1] \
                        is write[1]:
                    del self._pending_writes[write[0].dst]
                ready = [event for ticket, event in self._barriers if ticket <= self._done]
                self._barriers = [(t, e) for t, e in self._barriers if t > self._done]
            for event in ready:
                event.set()

    # -- copies ---------------------------------------------------------------------------------

    @staticmethod
    def _copy(source: KVLayers, destination: KVLayers, copies: list[TierCopy]) -> None:
        src = torch.tensor([copy.src for copy in copies], dtype=torch.int64)
        dst = torch.tensor([copy.dst for copy in copies], dtype=torch.int64)
        src_dev = src.to(source[0][0].device)
        dst_dev = dst.to(destination[0][0].device)
        for (src_k, src_v), (dst_k, dst_v) in zip(source, destination):
            dst_k.index_copy_(0, dst_dev, src_k.index_select(0, src_dev).to(dst_k.device))
            dst_v.index_copy_(0, dst_dev, src_v.index_select(0, src_dev).to(dst_v.device))

    def _payload(self, slot: int) -> bytes:
        block = torch.stack([torch.stack((k[slot], v[slot])) for k, v in self.host])
        return block.contiguous().view(torch.uint8).numpy().tobytes()

    def _spill(self, copy: TierCopy, payload: bytes) -> None:
        assert self.disk is not None
        try:
            self.disk.write(copy.dst, copy.block_hash, payload)
            self.bytes_spilled += len(payload)
        except Exception as error:  # noqa: BLE001 - a full or failing disk fails no request
            log.warning("KV disk tier: writing a block failed (%s); it is not kept on disk",
                        error)
            with self._lock:
                self._spill_failed.append(copy.block_hash)

    def _fetch(self, copy: TierCopy) -> None:
        assert self.disk is not None
        started = time.perf_counter()
        with self._lock:
            pending = self._pending_writes.get(copy.src)
        try:
            if pending is not None and pending[0] == copy.block_hash:
                payload = pending[1]  # its write has not run yet: the bytes are here
            else:
                payload = self.disk.read(copy.src, copy.block_hash)
            block = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
                self.dtype).view(self.block_shape)
            for layer, (k, v) in enumerate(self.host):
                k[copy.dst].copy_(block[layer, 0])
                v[copy.dst].copy_(block[layer, 1])
        except Exception as error:  # noqa: BLE001 - corrupt or unreadable: computed instead
            log.warning("KV disk tier: block in slot %d dropped (%s: %s); its tokens are "
                        "computed instead", copy.src, type(error).__name__, error)
            with self._lock:
                self._fetch_failed.append(copy.block_hash)
            return
        self.fetch_seconds += time.perf_counter() - started
        self.bytes_fetched += len(payload)
        with self._lock:
            self._fetched.append(copy.block_hash)


def measure_host_load_gb_per_s(device: torch.device, dtype: torch.dtype,
                               megabytes: int = 64, repeats: int = 3) -> float:
    """Host -> device copy bandwidth of a KV-sized transfer (pinned host memory on CUDA;
    an indexed memory copy, as the store makes it, on a CPU)."""
    elements = megabytes * 2**20 // (torch.finfo(dtype).bits // 8)
    rows = max(1, elements // 4096)
    pin = device.type == "cuda"
    host = torch.ones((rows, 4096), dtype=dtype, pin_memory=pin)
    target = torch.empty((rows, 4096), dtype=dtype, device=device)
    index = torch.arange(rows, device=device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.index_copy_(0, index, host.index_select(0, index.cpu()).to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return rows * 4096 * (torch.finfo(dtype).bits // 8) / best / 1e9


def measure_disk_read_gb_per_s(path: Path, megabytes: int = 64) -> float:
    """Read bandwidth of ``path``'s file system, past the page cache where the OS lets us
    drop it (a file written, synced, dropped from the cache, then read back)."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / ".bandwidth-probe"
    block = os.urandom(2**20)
    try:
        with open(probe, "wb") as out:
            for _ in range(megabytes):
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        with open(probe, "rb") as source:
            while source.read(8 * 2**20):
                pass
        elapsed = time.perf_counter() - started
    finally:
        probe.unlink(missing_ok=True)
    return megabytes * 2**20 / max(elapsed, 1e-6) / 1e9
