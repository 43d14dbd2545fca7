"""The decode role's side of a KV hand-off (``transfers.py``): requests waiting for blocks here,
then for their prompt's KV to arrive from a prefill instance. ``add``/``start_transfers``/
``poll``/``cancel`` run on the engine thread; the reads run on one transfer thread, which
hands finished imports back through a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from slipstream.agent.engine.kv.transfer.side_channel import SideChannelClient
from slipstream.agent.engine.kv.transfer.transport import KVHandle, KVTransferError, KVTransport
from slipstream.agent.scheduler.block_manager import (
    BlockManager, blocks_for_tokens, chain_block_hashes)
from slipstream.agent.scheduler.request import Request

log = logging.getLogger(__name__)

# How long the transfer thread waits for news of a streaming import: longer with one import
# in flight, shorter with several (it asks each in turn).
_LONG_POLL_S = 0.05
_SHORT_POLL_S = 0.005


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
