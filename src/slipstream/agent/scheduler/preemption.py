"""KV preemption mechanics: free a request's device blocks by recompute or by swap.

    Scheduler (KV pressure, victim from the policy) --> Preemptor.preempt()
        recompute: drop the KV, keep the tokens; the request is re-prefilled later
        swap:      copy the KV to host blocks (Batch.swap_out); copy back later (Batch.swap_in)

Either way nothing is lost: the generated tokens stay with the request, so it resumes and
produces the same output. Swap falls back to recompute when the host pool is full.

The runner must apply a batch's ``swap_out`` copies before its ``swap_in`` copies and before
the forward: device blocks freed by a swap-out may be handed to a chunk of the same batch.
The scheduler never swaps in and out in the same batch.

With prefix caching, swap-in first looks for the request's full, computed blocks in the
device cache (by their hashes): blocks another request still holds, or cached free blocks not
yet evicted, hold the same KV. The request takes those again, and only the rest is copied
back from host memory. A shared document prefix is then never held twice after a swap.
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
        """Bring a swapped request back to the device if its blocks fit above the reserve.

        Its leading full blocks still cached on the device are reused; the copy moves only
        the others (it is empty when every block was found)."""
        manager = self.block_manager
        host = request.host_block_ids
        full_blocks = min(len(host), request.num_computed_tokens // manager.block_size)
        reused = manager.match_blocks(request.block_hashes, full_blocks)
        fresh_count = len(host) - len(reused)
        needed = fresh_count + manager.device.num_reviving(reused)
        if needed + reserve_blocks > manager.kv_blocks_free:
            return None
        manager.device.acquire(reused)  # before allocating, so that allocation cannot evict them
        fresh = manager.device.allocate(fresh_count)
        manager.swap_in_reused_blocks += len(reused)
        copy = BlockCopy(tuple(host[len(reused):]), tuple(fresh))
        manager.release_host(host)
        request.block_ids = reused + fresh
        # The reused blocks are registered already; the copies are registered again as the
        # request runs.
        request.num_registered_blocks = len(reused)
        request.status = RequestStatus.RUNNING
        return copy

    def release(self, request: Request) -> None:
        self.block_manager.release(request.block_ids)
        self.block_manager.release_host(request.host_block_ids)
