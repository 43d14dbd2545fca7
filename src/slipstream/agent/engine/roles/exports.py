"""The prefill role's side of a KV hand-off (``transfers.py``): the blocks of requests whose KV
a decode instance has yet to read, held under transfer ids until it acknowledges them or the
hold times out. Called from the engine thread (``open``/``extend``/``finish``/``drop``/
``reclaim``) and from the side-channel thread (``lookup``/``progress``/``release``), hence
the lock.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from dataclasses import dataclass

from slipstream.agent.scheduler.block_manager import BlockManager

log = logging.getLogger(__name__)


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
