"""The iteration scheduler: owns the queues and the block manager, and emits one Batch per step.

There are no prefill or decode phases. Each running request has ``num_computed_tokens``
catching up to ``num_tokens``; a step grants each request some of its missing tokens. Running
decodes are granted first (one token each), then prefill chunks in queue order until the
packer's budget is spent. A chunk is admitted only if its KV blocks fit. When a decode cannot
get a block, the newest running request is preempted by recompute: its blocks are freed and it
goes back to the front of the queue with its generated tokens intact.

The engine calls, every iteration::

    batch = scheduler.schedule(now_s)
    sampled = runner.execute(batch)          # {request_id: token_id}
    scheduler.update(batch, sampled, now_s)
    ...engine checks stop conditions, then scheduler.finish(request_id, reason)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at once
    max_batched_tokens: int = 512  # token budget per iteration (prefill chunks + decodes)
    # KVP: a chunk never crosses from one KVP group into the next (Medha progressive KVP).
    kvp_tokens_per_group: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        if self.kvp_tokens_per_group is not None and self.kvp_tokens_per_group < 1:
            raise ValueError("kvp_tokens_per_group must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, reason: FinishReason, now_s: float | None = None) -> Request | None:
        """Remove a request and free its blocks at once. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.block_manager.release(request.block_ids)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_s = now_s
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one iteration ----------------------------------------------------------------------

    def schedule(self, now_s: float) -> Batch:
        budget = self.config.max_batched_tokens
        chunks: list[ScheduledChunk] = []

        # Oldest first, so that preemption (newest first) never hits a request already granted.
        decodes = sorted((r for r in self.running if not r.in_prefill and not r.in_flight),
                         key=lambda r: r.arrival_s)
        granted: set[str] = set()
        for request in decodes:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._reserve(request, request.num_tokens, granted):
                continue
            chunks.append(self._chunk(request, request.num_uncomputed_tokens))
            granted.add(request.request_id)
            budget -= 1

        in_prefill = [r for r in self.running if r.in_prefill and not r.in_flight]
        for request in in_prefill:
            if budget <= 0:
                break
            size = self._chunk_size(request, budget)
            if self.block_manager.can_grow(request.block_ids, request.num_computed_tokens + size):
                self.block_manager.grow(request.block_ids, request.num_computed_tokens + size)
                chunks.append(self._chunk(request, size))
                budget -= size

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            size = self._chunk_size(request, budget)
            if not self.block_manager.can_grow(request.block_ids, request.num_computed_tokens + size):
                break  # admission by free KV blocks; FCFS, so nobody jumps the head
            self.waiting.popleft()
            self.block_manager.grow(request.block_ids, request.num_computed_tokens + size)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_s is None:
                request.first_scheduled_s = now_s
            self.running.append(request)
            chunks.append(self._chunk(request, size))
            budget -= size

        return Batch(chunks=tuple(chunks))

    def update(self, batch: Batch, sampled: dict[str, int], now_s: float) -> None:
        """Advance each scheduled request past its chunk and append its sampled token."""
        for chunk in batch.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted while the batch ran
            request.num_computed_tokens = chunk.end_pos
            token = sampled.get(chunk.request_id)
            if chunk.sample and token is not None:
                request.output_token_ids.append(token)
                if request.first_token_s is None:
                    request.first_token_s = now_s

    # -- helpers ----------------------------------------------------------------------------

    def _chunk_size(self, request: Request, budget: int) -> int:
        size = min(request.num_uncomputed_tokens, budget)
        group = self.config.kvp_tokens_per_group
        if group is not None:
            size = min(size, group - request.num_computed_tokens % group)
        return size

    def _chunk(self, request: Request, size: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + size
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids(start, end)),
            start_pos=start,
            block_ids=tuple(request.block_ids),
            sample=end == request.num_tokens,
            sampling=request.sampling,
            num_generated=request.num_output_tokens,
        )

    def _reserve(self, request: Request, num_tokens: int, granted: set[str]) -> bool:
        """Grow ``request`` to ``num_tokens``, preempting the newest ungranted others if needed."""
        while not self.block_manager.can_grow(request.block_ids, num_tokens):
            victim = self._pick_victim(exclude=request, granted=granted)
            if victim is None:
                self._preempt(request)
                return False
            self._preempt(victim)
        self.block_manager.grow(request.block_ids, num_tokens)
        return True

    def _pick_victim(self, exclude: Request, granted: set[str]) -> Request | None:
        candidates = [r for r in self.running if r is not exclude and r.request_id not in granted]
        return max(candidates, key=lambda r: r.arrival_s) if candidates else None

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the KV, keep the tokens, requeue at the front."""
        self.running.remove(request)
        self.block_manager.release(request.block_ids)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
