"""Prefill/decode disaggregation inside one engine: the two halves of a KV hand-off.

An agent runs in one of three roles (``--role``):

- ``mixed`` (default): prefill and decode on the same instance, as always. Nothing here runs.
- ``prefill``: a request sent with ``kv_transfer_params: {"do_remote_decode": true}`` is
  prefilled, samples its first token and finishes; its KV blocks stay allocated under a
  transfer id (``KVExports``) and its output carries the handle (``KVHandle``) a decode
  instance needs. The blocks are freed when the decode instance acknowledges the transfer
  over the side channel, or when the hold times out (a decode instance that died).
- ``decode``: a request sent with ``kv_transfer_params`` = that handle (plus
  ``do_remote_prefill``) gets blocks for its prompt here, pulls the prompt's KV block by block
  on a transfer thread (``KVImports``), acknowledges, and joins the running decodes with the
  first token already generated. The engine keeps stepping its other requests meanwhile.

Both roles still serve ordinary requests: a router that falls back to one instance loses
nothing. Everything here that touches the block manager or the scheduler runs on the engine
thread; the side-channel and transfer threads only hand results over through queues.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slipstream.agent.engine.disagg_config import DisaggConfig
from slipstream.agent.engine.kv_transfer.layout import KVLayout, regions_of
from slipstream.agent.engine.kv_transfer.side_channel import SideChannelClient, SideChannelServer
from slipstream.agent.engine.kv_transfer.transport import (
    KVHandle, KVTransferError, KVTransport, make_transport, prompt_digest)
from slipstream.agent.scheduler.block_manager import (
    BlockManager, blocks_for_tokens, chain_block_hashes)
from slipstream.agent.scheduler.request import Request

log = logging.getLogger(__name__)

# How long the transfer thread waits for news of a streaming import: longer with one import
# in flight, shorter with several (it asks each in turn).
_LONG_POLL_S = 0.05
_SHORT_POLL_S = 0.005

# ---- prefill side -----------------------------------------------------------------------

@dataclass
class _Hold:
    block_ids: list[int]
    deadline_s: float  # infinite while the prefill still runs
    done: bool = False  # every prompt block is in ``block_ids`` and the first token is known
    first_token_id: int = -1


class KVExports:
    """Blocks held for decode instances, by transfer id. A hold opens when the prefill
    starts; the blocks of each completed prefill chunk are added as they are computed, so a
    decode instance can read them while later chunks compute; the last (partial) block and
    the first token close it. ``open``/``extend``/``finish``/``drop``/``reclaim`` run on the
    engine thread; ``lookup``/``progress``/``release`` on the side channel's thread. A hold
    owns one reference on each of its blocks (the request keeps its own until it ends)."""

    def __init__(self, block_manager: BlockManager, hold_timeout_s: float) -> None:
        self._block_manager = block_manager
        self._hold_timeout_s = hold_timeout_s
        self._lock = threading.Lock()
        self._held: dict[str, _Hold] = {}
        self._released: queue.SimpleQueue[tuple[int, ...]] = queue.SimpleQueue()
        self.num_released_total = 0
        self.num_expired_total = 0
        self.num_dropped_total = 0

    def open(self) -> str:
        transfer_id = uuid.uuid4().hex
        with self._lock:
            self._held[transfer_id] = _Hold([], float("inf"))
        return transfer_id

    def extend(self, transfer_id: str, block_ids: list[int]) -> bool:
        """Add newly computed blocks (the caller took a reference on each); False if the
        hold is gone (acknowledged early by a decode instance that gave up)."""
        with self._lock:
            hold = self._held.get(transfer_id)
            if hold is None or hold.done:
                return False
            hold.block_ids.extend(block_ids)
            return True

    def finish(self, transfer_id: str, block_ids: list[int], first_token_id: int,
               now_s: float) -> tuple[int, ...] | None:
        """Close a hold with its last blocks and the first token; the hold timeout starts
        now. Returns all its blocks, or None if the hold is gone."""
        with self._lock:
            hold = self._held.get(transfer_id)
            if hold is None or hold.done:
                return None
            hold.block_ids.extend(block_ids)
            hold.done, hold.first_token_id = True, first_token_id
            hold.deadline_s = now_s + self._hold_timeout_s
            return tuple(hold.block_ids)

    def hold(self, block_ids: list[int], now_s: float, first_token_id: int = -1) -> str:
        """Open and close a hold at once (blocks already referenced for it)."""
        transfer_id = self.open()
        self.finish(transfer_id, block_ids, first_token_id, now_s)
        return transfer_id

    def drop(self, transfer_id: str) -> None:
        """The prefill ended without a hand-off (aborted, failed, or finished at its first
        token): free the hold now; a decode instance reading it is told so."""
        with self._lock:
            hold = self._held.pop(transfer_id, None)
        if hold is not None:
            self._block_manager.release(hold.block_ids)
            self.num_dropped_total += 1

    def lookup(self, transfer_id: str) -> tuple[int, ...] | None:
        with self._lock:
            hold = self._held.get(transfer_id)
            return None if hold is None else tuple(hold.block_ids)

    def progress(self, transfer_id: str) -> tuple[tuple[int, ...], bool, int] | None:
        with self._lock:
            hold = self._held.get(transfer_id)
            if hold is None:
                return None
            return tuple(hold.block_ids), hold.done, hold.first_token_id

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            hold = self._held.pop(transfer_id, None)
        if hold is None:
            return False
        self._released.put(tuple(hold.block_ids))
        return True

    def reclaim(self, now_s: float) -> int:
        """Free released blocks and those held past their deadline; returns blocks freed."""
        freed = 0
        while True:
            try:
                block_ids = self._released.get_nowait()
            except queue.Empty:
                break
            self._block_manager.release(list(block_ids))
            self.num_released_total += 1
            freed += len(block_ids)
        with self._lock:
            expired = [tid for tid, hold in self._held.items() if hold.deadline_s <= now_s]
            holds = [self._held.pop(tid) for tid in expired]
        for hold in holds:
            log.warning("KV held for a decode instance was never acknowledged; freeing %d "
                        "blocks", len(hold.block_ids))
            self._block_manager.release(hold.block_ids)
            self.num_expired_total += 1
            freed += len(hold.block_ids)
        return freed

    @property
    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(hold.block_ids) for hold in self._held.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


# ---- decode side ------------------------------------------------------------------------

@dataclass
class KVImport:
    """One request whose KV is on its way from a prefill instance."""

    request: Request
    handle: KVHandle
    block_ids: list[int] = field(default_factory=list)
    # The first ``cached_blocks`` of ``block_ids`` are this instance's own prefix-cache blocks
    # holding the same tokens: only the blocks after them are transferred.
    cached_blocks: int = 0
    blocks_read: int = 0
    # Blocks read while the prefill instance was still computing later chunks (streaming).
    blocks_read_early: int = 0
    first_token_id: int = -1  # known from the start, or at the end of a streaming handle
    remote_block_ids: tuple[int, ...] = ()  # the holder's blocks known so far
    next_block: int = 0  # index of the first block not yet read
    cancelled: bool = False
    error: str | None = None
    started_s: float | None = None
    transfer_s: float = 0.0


class KVImports:
    """Requests waiting for blocks here, then for their KV to arrive. ``submit``/``poll``
    run on the engine thread; transfers run on one transfer thread."""

    def __init__(self, transport: KVTransport, client: SideChannelClient,
                 blocks_per_read: int, clock: Callable[[], float]) -> None:
        self._transport = transport
        self._client = client
        self._blocks_per_read = blocks_per_read
        self._clock = clock
        self.waiting: deque[KVImport] = deque()  # no blocks yet
        self.transferring: dict[str, KVImport] = {}
        self._todo: queue.SimpleQueue[KVImport | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[KVImport] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="slipstream-kv-import",
                                        daemon=True)
        self._thread.start()
        # Per-read timings (seconds, blocks) for the benchmark; bounded.
        self.read_log: deque[tuple[float, int]] = deque(maxlen=4096)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.transferring)

    def add(self, item: KVImport) -> None:
        self.waiting.append(item)

    def cancel(self, request_id: str) -> KVImport | None:
        """Forget a request that was aborted; its blocks are freed when its transfer ends."""
        for waiting in self.waiting:
            if waiting.request.request_id == request_id:
                # No blocks here yet; the transfer thread still acknowledges, so the
                # prefill instance frees its copy now rather than at its timeout.
                self.waiting.remove(waiting)
                waiting.cancelled = True
                self.transferring[request_id] = waiting
                self._todo.put(waiting)
                return waiting
        item = self.transferring.get(request_id)
        if item is not None:
            item.cancelled = True
        return item

    def start_transfers(self, block_manager: BlockManager) -> None:
        """Give waiting imports blocks, in arrival order, and start their transfers. A prompt
        prefix this instance's prefix cache already holds is shared, not transferred: the
        request takes those cached blocks and only the rest is read."""
        block_size = block_manager.block_size
        while self.waiting:
            item = self.waiting[0]
            request = item.request
            needed = blocks_for_tokens(item.handle.num_tokens, block_size)
            hashes = chain_block_hashes(b"", request.prompt_token_ids, block_size) \
                if block_manager.prefix_caching else []
            prefix = block_manager.match_prefix(hashes, item.handle.num_tokens)
            fresh = needed - len(prefix)
            if fresh + block_manager.device.num_reviving(prefix) > block_manager.kv_blocks_free:
                return  # running requests will finish and free blocks
            self.waiting.popleft()
            block_manager.device.acquire(prefix)
            item.block_ids = prefix + block_manager.device.allocate(fresh)
            item.cached_blocks = len(prefix)
            # The scheduler offers the received blocks to the prefix cache after its first
            # step; the shared prefix is registered already.
            request.block_hashes = hashes
            request.num_registered_blocks = len(prefix)
            self.transferring[request.request_id] = item
            self._todo.put(item)

    def poll(self) -> list[KVImport]:
        """Imports whose transfer ended (check ``error`` and ``cancelled``)."""
        finished: list[KVImport] = []
        while True:
            try:
                item = self._done.get_nowait()
            except queue.Empty:
                return finished
            self.transferring.pop(item.request.request_id, None)
            finished.append(item)

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(5)
        self._client.close()

    def _run(self) -> None:
        """Advance every import in turn: a streaming one reads the blocks its prefill has
        completed so far and then waits (a short long-poll) for more, so one long prefill
        never holds up the transfers behind it."""
        active: list[KVImport] = []
        while True:
            try:
                while True:
                    item = self._todo.get(block=not active)
                    if item is None:
                        return
                    active.append(item)
            except queue.Empty:
                pass
            wait_s = _LONG_POLL_S if len(active) == 1 else _SHORT_POLL_S
            for item in list(active):
                if item.started_s is None:
                    item.started_s = self._clock()
                try:
                    finished = self._advance(item, wait_s)
                except KVTransferError as error:
                    item.error, finished = str(error), True
                except Exception as error:  # noqa: BLE001 - one transfer must not stop the rest
                    log.exception("KV transfer failed")
                    item.error, finished = f"{type(error).__name__}: {error}", True
                if finished:
                    if item.error is None:
                        self._release_remote(item)
                    item.transfer_s = self._clock() - item.started_s
                    active.remove(item)
                    self._done.put(item)

    def _advance(self, item: KVImport, wait_s: float) -> bool:
        """Read what can be read of one import; True once it is complete (or cancelled)."""
        handle = item.handle
        if item.cancelled:
            return True
        done = True
        if handle.streaming:
            # Never wait longer than the side channel's timeout allows.
            wait_s = min(wait_s, self._client.timeout_s / 2)
            remote, done, first = self._client.progress(
                handle.side_channel, handle.transfer_id, len(item.remote_block_ids), wait_s)
            if len(remote) > len(item.block_ids) or (done and len(remote) != len(item.block_ids)) \
                    or remote[:len(item.remote_block_ids)] != item.remote_block_ids:
                raise KVTransferError(f"the prefill instance reported {len(remote)} blocks for "
                                      f"a prompt of {len(item.block_ids)} blocks")
            item.remote_block_ids = remote
            if done:
                item.first_token_id = first
        else:
            item.remote_block_ids = handle.block_ids
            item.first_token_id = handle.first_token_id
        self._read(item, early=not done)
        return done or item.cancelled

    def _read(self, item: KVImport, early: bool) -> None:
        """Read the known blocks not read yet (those after the prefix this instance holds)."""
        start = max(item.next_block, item.cached_blocks)
        end = len(item.remote_block_ids)
        step = self._blocks_per_read
        for first in range(start, end, step):
            if item.cancelled:
                return
            last = min(first + step, end)
            read_started = self._clock()
            self._transport.read_blocks(item.handle, list(item.remote_block_ids[first:last]),
                                        item.block_ids[first:last])
            item.blocks_read += last - first
            if early:
                item.blocks_read_early += last - first
            item.next_block = last
            self.read_log.append((self._clock() - read_started, last - first))
        item.next_block = max(item.next_block, end)

    def _release_remote(self, item: KVImport) -> None:
        """Acknowledge, so the prefill instance frees its blocks (best effort: it times out
        its holds anyway)."""
        try:
            self._client.request(item.handle.side_channel, ["release", item.handle.transfer_id])
        except KVTransferError as error:
            log.warning("could not acknowledge a KV transfer: %s", error)


# ---- the engine's side ------------------------------------------------------------------

class Disaggregation:
    """What an engine in the prefill or decode role owns: its transport, the side channel,
    and the exports or imports in progress."""

    def __init__(self, config: DisaggConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_manager: BlockManager, clock: Callable[[], float]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.layout = KVLayout.of(kv_caches)
        regions = regions_of(kv_caches)
        self.exports: KVExports | None = None
        self.imports: KVImports | None = None
        self.server: SideChannelServer | None = None
        client = SideChannelClient(config.transfer_timeout_s)
        self.transport = make_transport(config.transport, self.layout, regions, config.host,
                                        side_channel=client)
        if config.role == "prefill":
            self.exports = KVExports(block_manager, config.hold_timeout_s)
            self.server = SideChannelServer(
                config.host, config.side_channel_port, self.exports.lookup,
                self.exports.release, regions if config.transport == "zmq" else None,
                progress=self.exports.progress)
        elif config.role == "decode":
            self.imports = KVImports(self.transport, client, config.blocks_per_read, clock)
        self._ids = itertools.count()
        # Prefill side: request id -> (transfer id, blocks offered so far) while it prefills.
        self._open: dict[str, tuple[str, list[int]]] = {}
        device = regions[0].device if regions else torch.device("cpu")
        self._cuda_device = device if device.type == "cuda" else None
        # Decode side, cumulative (engine thread): the metrics' source.
        self.num_completed_total = 0
        self.num_failed_total = 0
        self.num_blocks_transferred_total = 0
        self.num_blocks_cached_total = 0
        self.num_blocks_overlapped_total = 0  # read while the prefill was still running
        log.info("disaggregation: role %s, %s transport%s", config.role, self.transport.name,
                 f", side channel {self.server.address}" if self.server else "")

    # prefill side

    def open_export(self, request: Request) -> KVHandle:
        """A request to be handed off has arrived: open its hold and return the streaming
        handle a decode instance can start reading from right away."""
        assert self.exports is not None
        transfer_id = self.exports.open()
        self._open[request.request_id] = (transfer_id, [])
        return self._handle(transfer_id, request, (), -1, streaming=True)

    def publish(self, request: Request, computed_tokens: int) -> None:
        """After a step: offer the request's prompt blocks that are now full and computed
        (engine thread). The hold takes its own reference on each, so they outlive a
        preemption of the request; a recomputed request's blocks are offered only past
        those already offered."""
        entry = self._open.get(request.request_id)
        if entry is None or self.exports is None:
            return
        transfer_id, offered = entry
        full = min(computed_tokens, request.prompt_len) // self.block_manager.block_size
        new = request.block_ids[len(offered):full]
        if not new:
            return
        self._sync_device()
        self.block_manager.device.acquire(new)
        if self.exports.extend(transfer_id, new):
            offered.extend(new)
        else:  # a decode instance gave up on it already
            self.block_manager.device.free(new)
            self._open.pop(request.request_id, None)

    def export(self, request: Request, now_s: float) -> KVHandle | None:
        """The request just sampled its first token: its remaining prompt blocks (the last,
        partial one) join the hold, which closes with the first token; the hold timeout
        starts now. Returns the complete handle, or None if no decode instance wants it any
        more."""
        entry = self._open.pop(request.request_id, None)
        if entry is None or self.exports is None:
            return None
        transfer_id, offered = entry
        keep = blocks_for_tokens(request.prompt_len, self.block_manager.block_size)
        rest = request.block_ids[len(offered):keep]
        self._sync_device()
        self.block_manager.device.acquire(rest)
        first_token_id = request.output_token_ids[0]
        block_ids = self.exports.finish(transfer_id, rest, first_token_id, now_s)
        if block_ids is None:
            self.block_manager.device.free(rest)
            return None
        return self._handle(transfer_id, request, block_ids, first_token_id, streaming=False)

    def drop(self, request_id: str) -> None:
        """The request ended without a hand-off: free its hold (engine thread)."""
        entry = self._open.pop(request_id, None)
        if entry is not None and self.exports is not None:
            self.exports.drop(entry[0])

    def _handle(self, transfer_id: str, request: Request, block_ids: tuple[int, ...],
                first_token_id: int, streaming: bool) -> KVHandle:
        assert self.server is not None
        return KVHandle(
            transfer_id=transfer_id, transport=self.transport.name,
            side_channel=self.server.address, endpoint=self.transport.endpoint,
            region_addrs=self.transport.region_addrs(), layout=self.layout,
            block_ids=block_ids, num_tokens=request.prompt_len,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            first_token_id=first_token_id, streaming=streaming)

    def _sync_device(self) -> None:
        """Blocks are offered once their KV is written: wait for the device's queued work
        (a no-op on the CPU, where the forward has returned by now)."""
        if self._cuda_device is not None:
            torch.cuda.synchronize(self._cuda_device)

    # decode side

    def check_handle(self, handle: KVHandle, prompt_token_ids: list[int]) -> None:
        """ValueError (a 400) if the handle cannot belong to this prompt or this instance."""
        if handle.num_tokens != len(prompt_token_ids) or \
                handle.prompt_digest != prompt_digest(prompt_token_ids):
            raise ValueError("kv_transfer_params belongs to another prompt: send the decode "
                             "instance the same prompt as the prefill instance")
        try:
            self.transport.check_compatible(handle)
        except KVTransferError as error:
            raise ValueError(str(error)) from None

    def blocks_received(self, request_id: str) -> int | None:
        """Decode side: prompt blocks of a request in transfer that have arrived so far
        (None once it has left the transfer: joined the decodes or failed)."""
        if self.imports is None:
            return None
        item = self.imports.transferring.get(request_id)
        return None if item is None else item.blocks_read

    def poll(self, now_s: float) -> list[KVImport]:
        """Engine thread, every step: free acknowledged exports; start and collect imports."""
        if self.exports is not None:
            self.exports.reclaim(now_s)
        if self.imports is None:
            return []
        self.imports.start_transfers(self.block_manager)
        finished = self.imports.poll()
        for item in finished:
            self.num_blocks_transferred_total += item.blocks_read
            self.num_blocks_overlapped_total += item.blocks_read_early
            if item.error is not None:
                self.num_failed_total += 1
            elif not item.cancelled:
                self.num_completed_total += 1
                self.num_blocks_cached_total += item.cached_blocks
        return finished

    @property
    def num_bytes_transferred_total(self) -> int:
        return self.num_blocks_transferred_total * self.layout.bytes_per_block

    @property
    def num_pending(self) -> int:
        """Imports not yet handed to the scheduler (the engine is busy while any remain)."""
        return len(self.imports) if self.imports is not None else 0

    def close(self) -> None:
        if self.imports is not None:
            self.imports.close()
        if self.server is not None:
            self.server.close()
        self.transport.close()
