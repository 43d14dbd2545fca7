"""The iteration scheduler: owns the queues and the block manager, and emits one Batch per step.

There are no prefill or decode phases. Each running request has ``num_computed_tokens``
catching up to ``num_tokens``; a step grants each request some of its missing tokens:

    schedule(now):
        release due short prefills          # only with AWD batching (short_batching.py)
        policy.on_step(now)                 # e.g. Justitia's virtual clock
        displace                            # SRPT only: a shorter waiting request evicts
        swap in                             # swapped requests come back when blocks allow
        grant every running decode          # KV pressure -> preempt the policy's victim
        PrefillBudget: decodes, then prefill chunks in policy order (packer.py); with
            several applications active, prefills with slack yield (shared_steps.py)
        -> Batch(decodes first, then prefill chunks, swap copies, predicted time)

A chunk is admitted only if its KV blocks fit. With a runtime predictor the budget is a time
(``target_batch_time_ms``); without one, time is proportional to tokens and the budget is
``max_batched_tokens``. The engine calls, every iteration::

    batch = scheduler.schedule(now_s)
    sampled = runner.execute(batch)          # {request_id: token_id}
    scheduler.update(batch, sampled, now_s)
    ...engine checks stop conditions, then scheduler.finish(request_id, reason, now_s)

Prefix caching (block_manager.py, prefix_reuse.py): ``add`` hashes the prompt's full blocks
and looks them up, so urgency, policies and AWD see only the uncached part of the prompt; a
new request is admitted with its longest cached prefix already computed (its shared blocks
acquired), and the packer prices its first chunk at that KV length; ``update`` registers every
block that a step filled, so later requests (and this one, after a recompute preemption) can
reuse it.

KV tiers (kv_tiers.py, tier_admission.py): the device pool's evictions go on to host memory
and disk. ``add`` looks the prompt up in every tier; a prefix that only the disk holds is
fetched to the host first, and the request waits outside the queue until
``apply_tier_results`` reports the fetch (done or failed). Admission loads the host-held part
of the prefix into new device blocks (``Batch.tier_ops``) instead of computing it, and the
packer charges the load's time to the batch.

Shared prompts (the API's ``n > 1``): a request added with ``share_prompt_with`` naming a
request of the same prompt that has not yet computed it is held back, outside the queue,
until that request's prompt blocks are registered (or it leaves: finished or preempted). It is
then queued and admitted like any other, finding those blocks in the cache, so the prompt's
full blocks are computed once; only its last, partial block is computed per request.

With ``short_prefill_batching="awd"``, ``add`` holds new short prompts back until AWD releases
them as a group, so a step can schedule nothing while requests wait. The engine then sleeps
until ``next_wakeup_s(now_s)`` (or a new request) instead of calling ``schedule`` in a loop.
"""

from __future__ import annotations

from slipstream.agent.scheduler.batch import Batch, BlockCopy, ScheduledChunk
from slipstream.agent.scheduler.block_manager import BlockManager, blocks_for_tokens
from slipstream.agent.scheduler.chunks import decode_chunk, prefill_chunk
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.kv_tiers import TierResults
from slipstream.agent.scheduler.memory_pressure import MemoryPressure
from slipstream.agent.scheduler.length_predictor import LengthPredictor, RunningMeanLengthPredictor
from slipstream.agent.scheduler.packer import PrefillBudget
from slipstream.agent.scheduler.policies import PolicyContext
from slipstream.agent.scheduler.prefill_packing import PrefillPacking
from slipstream.agent.scheduler.policy_registry import make_policy
from slipstream.agent.scheduler.predictor import BatchTimeModel, TokenBudgetModel
from slipstream.agent.scheduler.preemption import Preemptor
from slipstream.agent.scheduler.prefix_reuse import (hash_blocks, prompt_source, register_blocks,
                                                     shared_prompt_blocks)
from slipstream.agent.scheduler.prefill_time_cache import PrefillTimeCache
from slipstream.agent.scheduler.priority_index import PrefillQueue
from slipstream.agent.scheduler.request import FinishReason, Request, RequestStatus
from slipstream.agent.scheduler.shared_steps import SharedSteps
from slipstream.agent.scheduler.short_batching import ShortPrefillHold
from slipstream.agent.scheduler.tier_admission import FetchHold, lookup_prefix
from slipstream.agent.scheduler.urgency import UrgencyModel

__all__ = ["Scheduler", "SchedulerConfig"]

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING


class Scheduler(MemoryPressure, PrefillPacking):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 predictor: BatchTimeModel | None = None,
                 length_predictor: LengthPredictor | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        if predictor is None:
            self.model: BatchTimeModel = TokenBudgetModel(config.max_batched_tokens,
                                                          config.target_batch_time_ms)
            self.packer_config = config.token_budget_packer_config()
        else:
            self.model = predictor
            self.packer_config = config.packer_config()
        self.prefill_times = PrefillTimeCache(self.model, self.packer_config,
                                              spp_degree=config.spp_degree)
        self.urgency = UrgencyModel(self.prefill_times, config.min_ttft_deadline_s,
                                    config.ttft_deadline_factor)
        self.length_predictor = length_predictor or RunningMeanLengthPredictor()
        self.policy = make_policy(config.policy, PolicyContext(
            urgency=self.urgency,
            length_predictor=self.length_predictor,
            kv_capacity_tokens=max(1, block_manager.kv_blocks_total * block_manager.block_size),
            decode_step_s=config.target_batch_time_ms / 1000.0,
            srpt_preemptible_fraction=config.srpt_preemptible_fraction,
            short_lane_work_s=config.lars_short_lane_ms / 1000.0,
            late_reserve_fraction=config.lars_late_reserve_fraction,
            reserve_grace=config.lars_reserve_grace,
        ))
        self.queue = PrefillQueue(self.policy)
        self.shared_steps = SharedSteps(self.urgency, self.packer_config.target_batch_time_ms,
                                        config.shared_step_fraction, config.shared_step_window_s)
        self.preemptor = Preemptor(block_manager, swap=config.preemption == "swap")
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.short_prefills: ShortPrefillHold | None = None
        # Requests held until the request they share a prompt with has computed it.
        self.prompt_waiters: dict[str, list[Request]] = {}
        # Requests held until blocks of their prefix are fetched from the disk tier.
        self.fetch_hold = FetchHold(block_manager.tiers)
        if config.short_prefill_batching == "awd":
            # A token-budget iteration caps the group, so a released group fits one step.
            cap = config.max_batched_tokens if predictor is None else None
            self.short_prefills = ShortPrefillHold(config.awd_config(cap),
                                                   config.long_request_threshold_tokens)

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        capacity_tokens = self.block_manager.kv_blocks_total * self.block_manager.block_size
        if request.num_tokens + 1 > capacity_tokens:
            raise ValueError(f"request {request.request_id!r} needs {request.num_tokens + 1} KV "
                             f"tokens; the device holds {capacity_tokens}")
        request.status = WAITING
        self.requests[request.request_id] = request
        in_host: list[bytes] = []
        on_disk: list[bytes] = []
        if self.block_manager.prefix_caching:
            hash_blocks(request, request.num_tokens, self.block_manager.block_size)
            in_host, on_disk = lookup_prefix(self.block_manager, request)
        self.urgency.assign(request)
        self.policy.on_add(request, request.arrival_s)
        self.shared_steps.note_add(request, request.arrival_s)
        source = prompt_source(request, self.requests, self.block_manager)
        if source is not None:
            self.prompt_waiters.setdefault(source.request_id, []).append(request)
        elif on_disk and self.fetch_hold.hold(request, in_host, on_disk):
            pass  # queued by apply_tier_results once its prefix is up from disk
        elif self.short_prefills is not None and self.short_prefills.accepts(request):
            self.short_prefills.hold(request)  # queued when AWD releases its group
        else:
            self.queue.add_waiting(request, request.arrival_s)

    def add_running(self, request: Request, now_s: float) -> None:
        """Admit a request whose prompt KV already sits in ``request.block_ids`` (received
        from a prefill instance, see engine/roles/). It must be one token short of its
        next sample, with that token already in ``output_token_ids``; it joins the running
        decodes, and from then on it is scheduled (and may be preempted) like any other."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_uncomputed_tokens != 1:
            raise ValueError("a request admitted with its KV must be exactly one token short")
        needed = blocks_for_tokens(request.num_computed_tokens, self.block_manager.block_size)
        if len(request.block_ids) < needed:
            raise ValueError(f"request {request.request_id!r} holds {len(request.block_ids)} "
                             f"blocks for {request.num_computed_tokens} tokens")
        self.requests[request.request_id] = request
        self.urgency.assign(request)
        self.policy.on_add(request, now_s)
        self.shared_steps.note_add(request, now_s)
        request.status = RUNNING
        request.first_scheduled_s = now_s
        self.running.append(request)

    def finish(self, request_id: str, reason: FinishReason, now_s: float | None = None) -> Request | None:
        """Remove a request and free its blocks at once. Unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        if self.short_prefills is not None:
            self.short_prefills.remove(request)
        self.fetch_hold.remove(request)
        self._release_prompt_waiters(request, now_s if now_s is not None else request.arrival_s)
        waiters = self.prompt_waiters.get(request.share_prompt_with or "")
        if waiters is not None and request in waiters:
            waiters.remove(request)
            if not waiters:
                del self.prompt_waiters[request.share_prompt_with or ""]
        self.queue.remove(request)
        self.preemptor.release(request)
        self.urgency.forget(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_s = now_s
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.length_predictor.observe(request)
        self.policy.on_finish(request, now_s if now_s is not None else 0.0)
        self.shared_steps.note_finish(request, now_s if now_s is not None else request.arrival_s)
        return request

    def has_unfinished(self) -> bool:
        """True while any request is queued, held by AWD, running or swapped."""
        return bool(self.requests)

    def next_wakeup_s(self, now_s: float) -> float | None:
        """When ``schedule`` has new work without any new request: the time AWD's next held
        group falls due (``now_s`` if it already is), or None when nothing is held."""
        if self.short_prefills is None:
            return None
        return self.short_prefills.next_wakeup_s(now_s)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued, or held for short-prefill batching."""
        held = len(self.short_prefills) if self.short_prefills is not None else 0
        held += sum(len(waiters) for waiters in self.prompt_waiters.values())
        return len(self.queue.waiting) + held + len(self.fetch_hold)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one iteration ----------------------------------------------------------------------

    def schedule(self, now_s: float) -> Batch:
        if self.short_prefills is not None:
            for request in self.short_prefills.release_due(now_s):
                self.queue.add_waiting(request, now_s)
        self.policy.on_step(now_s)
        self.shared_steps.begin_step(now_s)
        self._displace(now_s)
        swap_in = self._swap_in(now_s)
        swap_out: list[BlockCopy] = []
        decodes = self._grant_decodes(now_s, swap_out)
        if self._unblock_head_prefill(now_s, swap_out):
            decodes = [request for request in decodes if request.status is RUNNING]
        budget = PrefillBudget(self.model, self.packer_config)
        # A decode's KV after this step is its start position + 1.
        budget.add_decodes(len(decodes), sum(r.num_computed_tokens for r in decodes) + len(decodes))
        grants = self._pack_prefills(now_s, budget)
        chunks = [decode_chunk(request) for request in decodes]
        chunks.extend(self._admit(request, size, now_s) for request, size in grants)
        tiers = self.block_manager.tiers
        tier_ops = tiers.take_ops() if tiers is not None else None
        batch = Batch(
            chunks=tuple(chunks),
            swap_out=tuple(swap_out),
            swap_in=tuple(swap_in),
            tier_ops=tier_ops or None,
            predicted_time_s=budget.time_ms / 1000.0,
            meta={"num_decodes": len(decodes), "num_prefills": len(grants),
                  "long_prefill": budget.has_long_prefill},
        )
        if self.short_prefills is not None:
            self.short_prefills.note_scheduled(batch, now_s)
        return batch

    def update(self, batch: Batch, sampled: dict[str, int], now_s: float) -> None:
        """Advance each scheduled request past its chunk and append its sampled token."""
        prefilling = self.queue.prefilling
        caching = self.block_manager.prefix_caching
        block_size = self.block_manager.block_size
        for chunk in batch.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RUNNING:
                continue  # finished or aborted while the batch ran
            request.num_computed_tokens = chunk.end_pos
            if caching and chunk.end_pos // block_size > request.num_registered_blocks:
                register_blocks(self.block_manager, request)
            if self.prompt_waiters and request.request_id in self.prompt_waiters and \
                    request.num_registered_blocks >= shared_prompt_blocks(request, block_size):
                self._release_prompt_waiters(request, now_s)
            token = sampled.get(chunk.request_id)
            if chunk.sample and token is not None:
                request.output_token_ids.append(token)
                if request.first_token_s is None:
                    request.first_token_s = now_s
            if request in prefilling:
                self.queue.rekey(request, now_s)
        if self.short_prefills is not None:
            self.short_prefills.observe_step(batch, now_s)

    def apply_tier_results(self, results: TierResults, now_s: float) -> None:
        """The tier store's report (fetches done or failed, spills failed): requests whose
        prefix is up from disk, or will not be, join the queue."""
        tiers = self.block_manager.tiers
        if tiers is None:
            return
        tiers.apply_results(results)
        for request in self.fetch_hold.release():
            lookup_prefix(self.block_manager, request)  # what is there now; no new fetch
            self.queue.add_waiting(request, now_s)

    def recompute_after_failed_load(self, device_blocks: tuple[int, ...], now_s: float
                                    ) -> list[str]:
        """A load from a lower tier into these device blocks failed: forget their hashes
        and recompute every running request that holds one; returns those requests' ids."""
        self.block_manager.device.unregister(device_blocks)
        failed = set(device_blocks)
        victims = [r for r in self.running if failed.intersection(r.block_ids)]
        for request in victims:
            self._preempt(request, now_s, swap_out=None)
        return [request.request_id for request in victims]

    # -- steps of schedule() ----------------------------------------------------------------

    # -- state changes ----------------------------------------------------------------------

    def _admit(self, request: Request, size: int, now_s: float) -> ScheduledChunk:
        self.block_manager.grow(request.block_ids, request.num_computed_tokens + size)
        if request.status is WAITING:
            request.status = RUNNING
            self.running.append(request)
            if request.first_scheduled_s is None:
                request.first_scheduled_s = now_s
                request.num_cached_tokens = request.num_computed_tokens
                self.block_manager.prefix_lookup_tokens += request.prompt_len
                self.block_manager.prefix_hit_tokens += request.num_computed_tokens
            if size < request.num_uncomputed_tokens:
                self.queue.start_prefilling(request, now_s)
            else:
                self.queue.remove(request)
        return prefill_chunk(request, size)

    # -- shared prompts (prefix_reuse.py has the request side of prefix caching) ------------


