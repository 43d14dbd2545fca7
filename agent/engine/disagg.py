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

# ---- prefill side -----------------------------------------------------------------------

@dataclass
class _Hold:
    block_ids: tuple[int, ...]
    deadline_s: float


class KVExports:
    """Blocks held for decode instances, by transfer id. ``hold``/``reclaim`` run on the
    engine thread; ``lookup``/``release`` on the side channel's thread."""

    def __init__(self, block_manager: BlockManager, hold_timeout_s: float) -> None:
        self._block_manager = block_manager
        self._hold_timeout_s = hold_timeout_s
        self._lock = threading.Lock()
        self._held: dict[str, _Hold] = {}
        self._released: queue.SimpleQueue[tuple[int, ...]] = queue.SimpleQueue()
        self.num_released_total = 0
        self.num_expired_total = 0

    def hold(self, block_ids: list[int], now_s: float) -> str:
        transfer_id = uuid.uuid4().hex
        with self._lock:
            self._held[transfer_id] = _Hold(tuple(block_ids), now_s + self._hold_timeout_s)
        return transfer_id

    def lookup(self, transfer_id: str) -> tuple[int, ...] | None:
        with self._lock:
            hold = self._held.get(transfer_id)
        return None if hold is None else hold.block_ids

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            hold = self._held.pop(transfer_id, None)
        if hold is None:
            return False
        self._released.put(hold.block_ids)
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
            self._block_manager.release(list(hold.block_ids))
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
    cancelled: bool = False
    error: str | None = None
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
        while (item := self._todo.get()) is not None:
            started = self._clock()
            try:
                self._transfer(item)
            except KVTransferError as error:
                item.error = str(error)
            except Exception as error:  # noqa: BLE001 - one transfer must not stop the thread
                log.exception("KV transfer failed")
                item.error = f"{type(error).__name__}: {error}"
            item.transfer_s = self._clock() - started
            self._done.put(item)

    def _transfer(self, item: KVImport) -> None:
        skip = item.cached_blocks
        remote, local = list(item.handle.block_ids[skip:]), item.block_ids[skip:]
        step = self._blocks_per_read
        for start in range(0, len(remote), step):
            if item.cancelled:
                break
            read_started = self._clock()
            self._transport.read_blocks(item.handle, remote[start:start + step],
                                        local[start:start + step])
            item.blocks_read += len(remote[start:start + step])
            self.read_log.append((self._clock() - read_started, len(remote[start:start + step])))
        self._release_remote(item)

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
                self.exports.release, regions if config.transport == "zmq" else None)
        elif config.role == "decode":
            self.imports = KVImports(self.transport, client, config.blocks_per_read, clock)
        self._ids = itertools.count()
        # Decode side, cumulative (engine thread): the metrics' source.
        self.num_completed_total = 0
        self.num_failed_total = 0
        self.num_blocks_transferred_total = 0
        self.num_blocks_cached_total = 0
        log.info("disaggregation: role %s, %s transport%s", config.role, self.transport.name,
                 f", side channel {self.server.address}" if self.server else "")

    # prefill side

    def export(self, request: Request, now_s: float) -> KVHandle:
        """Take the prompt KV of a request that just sampled its first token away from it:
        the blocks stay allocated under a transfer id until the decode side acknowledges."""
        assert self.exports is not None and self.server is not None
        prompt_len = request.prompt_len
        keep = blocks_for_tokens(prompt_len, self.block_manager.block_size)
        block_ids, request.block_ids = request.block_ids[:keep], request.block_ids[keep:]
        transfer_id = self.exports.hold(block_ids, now_s)
        return KVHandle(
            transfer_id=transfer_id, transport=self.transport.name,
            side_channel=self.server.address, endpoint=self.transport.endpoint,
            region_addrs=self.transport.region_addrs(), layout=self.layout,
            block_ids=tuple(block_ids), num_tokens=prompt_len,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            first_token_id=request.output_token_ids[0])

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
