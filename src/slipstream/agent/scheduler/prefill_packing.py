"""Phase 2 of a step: which prefill chunks join the batch, in policy order, until the time
budget is full (Medha's packer, packer.py, prices each chunk). With several applications
active, a prefill with slack yields (shared_steps.py). ``Scheduler`` (scheduler.py) mixes this
in; the state it reads is declared here."""

from __future__ import annotations

from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.packer import PrefillBudget
from slipstream.agent.scheduler.prefix_reuse import take_prefix
from slipstream.agent.scheduler.priority_index import PrefillQueue
from slipstream.agent.scheduler.request import Request, RequestStatus
from slipstream.agent.scheduler.shared_steps import SharedSteps
from slipstream.agent.scheduler.tier_admission import host_prefix, load_host_prefix
from slipstream.agent.scheduler.policies import SchedulingPolicy

RUNNING = RequestStatus.RUNNING
WAITING = RequestStatus.WAITING


class PrefillPacking:
    config: SchedulerConfig
    block_manager: BlockManager
    policy: SchedulingPolicy
    queue: PrefillQueue
    running: list[Request]
    swapped: list[Request]
    shared_steps: SharedSteps

    def _pack_prefills(self, now_s: float, budget: PrefillBudget) -> list[tuple[Request, int]]:
        """Phase 2 of Algorithm 1: prefill chunks in policy order until the budget is full.

        A policy may reserve part of the batch for one request (LARS: its oldest late long
        prefill): everyone else packs against the reduced budget, then that request fills
        the rest, so the reserve is a floor and the batch stays full.
        """
        config, manager, policy = self.config, self.block_manager, self.policy
        shared_steps = self.shared_steps
        block_size = manager.block_size
        caching = manager.prefix_caching
        tiers = manager.tiers
        seats = config.max_num_seqs - len(self.running)
        free_blocks = manager.kv_blocks_free
        watermark = int(config.admission_watermark_fraction * manager.kv_blocks_total)
        waiting_blocked = False
        grants: list[tuple[Request, int]] = []
        # Swapped requests resume before anything new is admitted.
        include_waiting = seats > 0 and not self.swapped

        def grant(request: Request, limit_ms: float | None = None) -> bool:
            nonlocal seats, free_blocks, waiting_blocked
            is_new = request.status is WAITING
            size = 0
            prefix: list[int] = []
            loads: list[bytes] = []  # host-tier blocks past the device prefix
            load_ms = 0.0
            reviving = 0
            if not (is_new and (seats <= 0 or waiting_blocked)):
                if is_new and caching and not request.block_ids:
                    # Start after the longest cached prefix; its free blocks stop being free.
                    prefix = manager.match_prefix(request.block_hashes, request.num_tokens)
                    reviving = manager.device.num_reviving(prefix)
                    if tiers is not None:
                        loads = host_prefix(manager, request, len(prefix))
                        load_ms = tiers.config.load_ms(len(loads))
                kv_before = request.num_computed_tokens + (len(prefix) + len(loads)) * block_size
                room = free_blocks - reviving - len(loads) - (watermark if is_new else 0)
                fit_tokens = (len(request.block_ids) + len(prefix) + len(loads) + room) \
                    * block_size - kv_before
                slack = policy.space_share_slack(request, now_s) if budget.is_long(kv_before) else 0.0
                size = budget.chunk_for(kv_before, request.num_tokens - kv_before, slack,
                                        fit_tokens, load_ms, limit_ms)
            if size <= 0:
                waiting_blocked |= is_new and policy.head_of_line_blocking
                return False
            if prefix or loads:
                take_prefix(self.block_manager, request, prefix)
                free_blocks -= reviving
            if loads:
                load_host_prefix(manager, request, loads, request.first_scheduled_s is None)
                free_blocks -= len(loads)
            budget.add_prefill(kv_before, size, load_ms)
            free_blocks -= manager.blocks_needed(request.block_ids, kv_before + size)
            seats -= is_new
            grants.append((request, size))
            return True

        reserved: Request | None = None
        reservation = self._reserved_prefill(now_s, include_waiting)
        if reservation is not None:
            reserved, fraction = reservation
            budget.reserve(fraction, long_slot=budget.is_long(reserved.num_computed_tokens))
        misses = 0
        yielding: list[tuple[Request, float]] = []  # requests with slack: packed last
        for request in self.queue.candidates(now_s, include_waiting):
            if budget.exhausted:
                break
            if request.in_flight or request is reserved:
                continue  # SPP: the token of its last chunk is not back yet; or packed last
            limit_ms = shared_steps.chunk_limit_ms(request, now_s)
            if limit_ms is not None:
                yielding.append((request, limit_ms))
            elif not grant(request):
                misses += 1
                if misses >= config.max_prefill_candidates:
                    break
        if reserved is not None:
            budget.release_reserve()
            grant(reserved)
        # Shared steps: a request with slack joins no batch that holds another application's
        # prefill (that prefill's first token would wait for it), and then only a short chunk.
        for request, limit_ms in yielding:
            if budget.exhausted:
                break
            if all(other.app_id == request.app_id for other, _ in grants):
                grant(request, limit_ms)
        return grants

    def _reserved_prefill(self, now_s: float, include_waiting: bool
                          ) -> tuple[Request, float] | None:
        """The request the policy keeps a share of this batch for, if any, and the share."""
        prefilling, waiting = self.queue.prefilling.members, self.queue.waiting.members
        return self.policy.reserved_request(now_s, lambda r: not r.in_flight and (
            r in prefilling or (include_waiting and r in waiting)))
