"""Requests ordered for the packer without re-sorting them every iteration.

    policies.py (keys) --> PrefillQueue (this file) --candidates(now)--> packer loop

Each policy gives a request a *time-invariant* key and a bucket. Inside a bucket requests sit
in a sorted list (insertion and removal by bisection, a C-level memmove), so ordering cost is
paid once per state change, not once per iteration. A policy whose order does change with
time (LARS) puts requests whose order cannot cross into the same bucket and gives each bucket
a scale, so that a request's score at ``now`` is ``(key - now) * scale``; only the bucket
heads are scored, and the iterator merges buckets with a heap. The packer pulls
candidates lazily and stops after a bounded number, so one ``schedule()`` touches a few dozen
requests even with 10,000 waiting.

Two indexes form the queue: waiting requests (no KV yet, or preempted) and running requests
that are still prefilling. Seats and memory decide whether waiting ones may be offered at all.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from typing import TYPE_CHECKING, Any, Hashable, Iterator, KeysView, Mapping

from slipstream.agent.scheduler.request import Request

if TYPE_CHECKING:
    from slipstream.agent.scheduler.policies import SchedulingPolicy

# Per-bucket scale of a score linear in time: score = (key - now_s) * scale[bucket].
ScoreScale = Mapping[Any, float]  # keyed by a policy's own (hashable) buckets


class PriorityIndex:
    """Sorted buckets of ``(key, seq, request)``; ``seq`` keeps ties first-come first-served."""

    def __init__(self, seq: Iterator[int] | None = None) -> None:
        self._buckets: dict[Hashable, list[tuple[float, int, Request]]] = {}
        self._entries: dict[Request, tuple[Hashable, float, int]] = {}
        # Shared between indexes that get merged, so (score, seq) never ties across them.
        self._seq = seq if seq is not None else itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: Request) -> bool:
        return request in self._entries

    @property
    def members(self) -> KeysView[Request]:
        """A live view for fast membership tests in hot loops (no Python-level call per test)."""
        return self._entries.keys()

    def add(self, request: Request, key: float, bucket: Hashable = 0) -> None:
        if request in self._entries:
            raise ValueError(f"{request.request_id} is already indexed")
        seq = next(self._seq)
        bisect.insort(self._buckets.setdefault(bucket, []), (key, seq, request))
        self._entries[request] = (bucket, key, seq)

    def remove(self, request: Request) -> bool:
        entry = self._entries.pop(request, None)
        if entry is None:
            return False
        bucket, key, seq = entry
        items = self._buckets[bucket]
        del items[bisect.bisect_left(items, (key, seq))]
        if not items:
            del self._buckets[bucket]
        return True

    def ordered(self, now_s: float, scale: ScoreScale | None = None) -> Iterator[tuple[float, int, Request]]:
        """``(score, seq, request)`` in ascending score. Do not mutate the index meanwhile.

        Without ``scale`` the key is the score. With it, only bucket heads are scored (inline
        arithmetic, no call per bucket) and a heap merges the buckets.
        """
        if scale is None:
            if len(self._buckets) == 1:
                yield from next(iter(self._buckets.values()))
                return
            yield from heapq.merge(*self._buckets.values())
            return
        heads = [((items[0][0] - now_s) * scale[bucket], items[0][1], bucket, 0)
                 for bucket, items in self._buckets.items()]
        heapq.heapify(heads)
        while heads:
            value, seq, bucket, position = heads[0]
            items = self._buckets[bucket]
            yield value, seq, items[position][2]
            position += 1
            if position < len(items):
                key, next_seq, _ = items[position]
                heapq.heapreplace(heads, ((key - now_s) * scale[bucket], next_seq, bucket, position))
            else:
                heapq.heappop(heads)


class PrefillQueue:
    """Waiting requests and running prefills, in the policy's order."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        seq = itertools.count()
        self.waiting = PriorityIndex(seq)
        self.prefilling = PriorityIndex(seq)

    def add_waiting(self, request: Request, now_s: float) -> None:
        bucket, key = self.policy.prefill_key(request, now_s)
        self.waiting.add(request, key, bucket)

    def start_prefilling(self, request: Request, now_s: float) -> None:
        self.waiting.remove(request)
        bucket, key = self.policy.prefill_key(request, now_s)
        self.prefilling.add(request, key, bucket)

    def rekey(self, request: Request, now_s: float) -> None:
        """A running prefill advanced: its key changes, or it left prefill for decode."""
        self.prefilling.remove(request)
        if request.in_prefill:
            bucket, key = self.policy.prefill_key(request, now_s)
            self.prefilling.add(request, key, bucket)

    def remove(self, request: Request) -> None:
        self.waiting.remove(request) or self.prefilling.remove(request)

    def first_waiting(self, now_s: float) -> Request | None:
        for _, _, request in self.waiting.ordered(now_s, self.policy.score_scale):
            return request
        return None

    def candidates(self, now_s: float, include_waiting: bool) -> Iterator[Request]:
        scale = self.policy.score_scale
        running = self.prefilling.ordered(now_s, scale)
        if not include_waiting or not self.waiting:
            return (request for _, _, request in running)
        waiting = self.waiting.ordered(now_s, scale)
        if self.policy.running_first:
            return (request for _, _, request in itertools.chain(running, waiting))
        return (request for _, _, request in heapq.merge(running, waiting))
