"""How the scheduler makes room: the KV cache's pressure on running requests.

    displace      TRAIL-style limited preemption: a shorter waiting request evicts a longer
                  runner when seats or blocks are short (SRPT-like policies only)
    swap in       swapped requests come back, least urgent last, while blocks allow
    grant decodes a block for every running decode; under pressure the policy's victim goes
    unblock head  the most urgent running prefill takes blocks from less urgent requests
    preempt       recompute (back to the queue) or swap out (to host memory)

``Scheduler`` (scheduler.py) mixes these in; they read and change its queues and its block
manager, declared here so that each side type-checks on its own.
"""

from __future__ import annotations

from slipstream.agent.scheduler.batch import BlockCopy
from slipstream.agent.scheduler.block_manager import BlockManager, blocks_for_tokens
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.packer import PackerConfig
from slipstream.agent.scheduler.policies import SchedulingPolicy
from slipstream.agent.scheduler.preemption import Preemptor
from slipstream.agent.scheduler.priority_index import PrefillQueue
from slipstream.agent.scheduler.request import Request, RequestStatus
from slipstream.agent.scheduler.tier_admission import lookup_prefix
from slipstream.agent.scheduler.urgency import UrgencyModel

RUNNING = RequestStatus.RUNNING


class MemoryPressure:
    config: SchedulerConfig
    block_manager: BlockManager
    packer_config: PackerConfig
    policy: SchedulingPolicy
    queue: PrefillQueue
    preemptor: Preemptor
    urgency: UrgencyModel
    running: list[Request]
    swapped: list[Request]
    prompt_waiters: dict[str, list[Request]]
    num_preemptions_total: int

    def _displace(self, now_s: float) -> None:
        """TRAIL-style limited preemption: a shorter waiting request evicts a longer runner."""
        if not self.policy.can_displace or not self.queue.waiting or not self.running:
            return
        for _ in range(self.config.max_displacements_per_step):
            head = self.queue.first_waiting(now_s)
            if head is None or not self.running:  # nobody left to admit, or to evict
                return
            first_chunk = min(head.num_uncomputed_tokens, self.packer_config.initial_chunk_tokens)
            seats_full = len(self.running) >= self.config.max_num_seqs
            memory_short = self.block_manager.kv_blocks_free < blocks_for_tokens(
                first_chunk, self.block_manager.block_size)
            if not (seats_full or memory_short):
                return
            victim = max(self.running, key=lambda r: self.policy.victim_key(r, now_s))
            if not self.policy.may_displace(head, victim, now_s):
                return
            self._preempt(victim, now_s, swap_out=None)  # early preemption: recompute is cheap

    def _swap_in(self, now_s: float) -> list[BlockCopy]:
        copies: list[BlockCopy] = []
        if not self.swapped:
            return copies
        # Keep a block per running request free so their decodes can grow without preempting.
        reserve = len(self.running)
        for request in sorted(self.swapped, key=lambda r: self.policy.urgency(r, now_s)):
            if len(self.running) >= self.config.max_num_seqs:
                break
            copy = self.preemptor.swap_in(request, reserve_blocks=reserve + 1)
            if copy is None:
                break
            if copy.src_block_ids:  # empty when every block was still cached on the device
                copies.append(copy)
            self.swapped.remove(request)
            self.running.append(request)
            if request.in_prefill:
                self.queue.start_prefilling(request, now_s)
            reserve += 1
        return copies

    def _grant_decodes(self, now_s: float, swap_out: list[BlockCopy]) -> list[Request]:
        """Reserve a block for every running decode, preempting the least urgent if needed."""
        manager = self.block_manager
        block_size = manager.block_size
        # Running requests are either in the prefilling index or decoding (one token short).
        prefilling = self.queue.prefilling.members
        decodes = [r for r in self.running if r not in prefilling and not r.in_flight]
        shortfall = [r for r in decodes
                     if r.num_computed_tokens // block_size >= len(r.block_ids)]
        if len(shortfall) <= manager.kv_blocks_free:  # the common case: no pressure, no sorting
            for request in shortfall:
                request.block_ids.extend(manager.device.allocate(1))
            return decodes
        order = sorted(self.running, key=lambda r: self.policy.victim_key(r, now_s))
        granted: list[Request] = []
        tail = len(order) - 1
        for request in order:
            if request.status is not RUNNING or request in self.queue.prefilling \
                    or request.in_flight:
                continue
            while not manager.can_grow(request.block_ids, request.num_tokens):
                while tail >= 0 and order[tail].status is not RUNNING:
                    tail -= 1
                victim = order[tail] if tail >= 0 else request
                if victim is request:
                    self._preempt(request, now_s, swap_out)
                    break
                self._preempt(victim, now_s, swap_out)
            else:
                manager.grow(request.block_ids, request.num_tokens)
                granted.append(request)
        return granted

    def _unblock_head_prefill(self, now_s: float, swap_out: list[BlockCopy]) -> bool:
        """Let the most urgent running prefill take blocks from less urgent running requests.

        Prefill chunks never preempt on their own, so running prefills could otherwise fill
        the cache and wait on each other forever. Only the head is served this way.
        """
        head = next(self.queue.prefilling.ordered(now_s, self.policy.score_scale), None)
        if head is None:
            return False
        request = head[2]
        manager = self.block_manager
        next_tokens = request.num_computed_tokens + min(request.num_uncomputed_tokens,
                                                        self.packer_config.min_chunk_tokens)
        need = manager.blocks_needed(request.block_ids, next_tokens)
        if need <= manager.kv_blocks_free:
            return False
        urgency = self.policy.urgency
        head_urgency = urgency(request, now_s)
        # Ties count as less urgent than the head: under FCFS, requests that arrived together
        # score alike, and a strict comparison left them holding the cache against each other.
        victims = sorted((r for r in self.running
                          if r is not request and urgency(r, now_s) >= head_urgency),
                         key=lambda r: urgency(r, now_s), reverse=True)
        preempted = False
        for victim in victims:
            if need <= manager.kv_blocks_free:
                break
            self._preempt(victim, now_s, swap_out)
            preempted = True
        return preempted

    def _preempt(self, request: Request, now_s: float, swap_out: list[BlockCopy] | None) -> None:
        self._release_prompt_waiters(request, now_s)
        self.running.remove(request)
        self.queue.remove(request)
        computed_tokens = request.num_computed_tokens
        copy = self.preemptor.preempt(request, allow_swap=swap_out is not None)
        self.num_preemptions_total += 1
        if copy is not None and swap_out is not None:  # preempt() swaps only when allowed
            swap_out.append(copy)
            self.swapped.append(request)
            return
        self.urgency.note_recompute(request, computed_tokens)
        self.queue.add_waiting(request, now_s)

    def _release_prompt_waiters(self, source: Request, now_s: float) -> None:
        """Queue the requests held for ``source``'s prompt; each looks up the cache again."""
        waiters = self.prompt_waiters.pop(source.request_id, None)
        if not waiters:
            return
        manager = self.block_manager
        for request in waiters:
            lookup_prefix(manager, request)
            self.queue.add_waiting(request, now_s)
