"""KV preemption mechanics: free a request's device blocks by recompute or by swap.

    Scheduler (KV pressure, victim from the policy) --> Preemptor.preempt()
        recompute: drop the KV, keep the tokens; the request is re-prefilled later
        swap:      copy the KV to host blocks (Batch.swap_out); copy back later (Batch.swap_in)

Either way nothing is lost: the generated tokens stay with the request, so it resumes and
produces the same output. Swap falls back to recompute when the host pool is full.

The runner must apply a batch's ``swap_out`` copies before its ``swap_in`` copies and before
the forward: device blocks freed by a swap-out may be handed to a chunk of the same batch.
The scheduler never swaps in and out in the same batch.
"""

from __future__ import annotations

from slipstream.agent.scheduler.batch import BlockCopy
from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.request import Request, RequestStatus


class Preemptor:
    def __init__(self, block_manager: BlockManager, swap: bool) -> None:
        self.block_manager = block_manager
        self.swap = swap

    def preempt(self, request: Request, allow_swap: bool = True) -> BlockCopy | None:
        """Free ``request``'s device blocks; returns the swap-out copy, or None for recompute."""
        request.num_preemptions += 1
        request.num_registered_blocks = 0  # its blocks go; the cache keeps the hashed ones
        if self.swap and allow_swap and request.block_ids:
            host_block_ids = self.block_manager.swap_out(request.block_ids)
            if host_block_ids is not None:
                copy = BlockCopy(tuple(request.block_ids), tuple(host_block_ids))
                self.block_manager.release(request.block_ids)
                request.host_block_ids = host_block_ids
                request.status = RequestStatus.SWAPPED
                return copy
        self.block_manager.release(request.block_ids)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        return None

    def swap_in(self, request: Request, reserve_blocks: int = 0) -> BlockCopy | None:
        """Bring a swapped request back to the device if its blocks fit above the reserve."""
        if len(request.host_block_ids) + reserve_blocks > self.block_manager.kv_blocks_free:
            return None
        device_block_ids = self.block_manager.swap_in(request.host_block_ids)
        if device_block_ids is None:
            return None
        copy = BlockCopy(tuple(request.host_block_ids), tuple(device_block_ids))
        self.block_manager.release_host(request.host_block_ids)
        request.block_ids = device_block_ids
        request.num_registered_blocks = 0  # fresh copies; registered again as they are used
        request.status = RequestStatus.RUNNING
        return copy

    def release(self, request: Request) -> None:
        self.block_manager.release(request.block_ids)
        self.block_manager.release_host(request.host_block_ids)
