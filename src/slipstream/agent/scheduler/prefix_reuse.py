"""The request side of prefix caching and shared prompts (block_manager.py holds the cache).

- ``hash_blocks`` extends a request's block hash chain, ``register_blocks`` offers its full,
  computed blocks to the cache, and ``take_prefix`` admits it with cached blocks as its
  computed prefix.
- Shared prompts (the API's ``n > 1``): ``prompt_source`` names the request whose prefill
  another should wait for, and ``shared_prompt_blocks`` says how many blocks it will find.

The scheduler calls these; which requests wait, and when they are queued, stays there.
"""

from __future__ import annotations

from collections.abc import Mapping

from slipstream.agent.scheduler.block_manager import BlockManager, chain_block_hashes
from slipstream.agent.scheduler.request import Request


def hash_blocks(request: Request, num_tokens: int, block_size: int) -> None:
    """Extend the request's block hash chain over the full blocks of its first
    ``num_tokens`` tokens."""
    hashes = request.block_hashes
    start = len(hashes) * block_size
    end = num_tokens // block_size * block_size
    if end > start:
        hashes.extend(chain_block_hashes(hashes[-1] if hashes else b"",
                                         request.token_ids(start, end), block_size))


def register_blocks(manager: BlockManager, request: Request) -> None:
    """Offer every full, computed block of the request to the prefix cache."""
    full = min(request.num_computed_tokens // manager.block_size, len(request.block_ids))
    hash_blocks(request, full * manager.block_size, manager.block_size)
    manager.register(request.block_ids, request.block_hashes,
                     request.num_registered_blocks, full)
    request.num_registered_blocks = full


def take_prefix(manager: BlockManager, request: Request, prefix: list[int]) -> None:
    """Admit ``request`` with the cached blocks ``prefix`` as its computed prefix."""
    manager.device.acquire(prefix)
    manager.device.note_reused(prefix)
    request.block_ids = list(prefix)
    request.num_computed_tokens = len(prefix) * manager.block_size
    request.num_registered_blocks = len(prefix)
    request.prefix_hit_tokens = request.num_computed_tokens


def prompt_source(request: Request, requests: Mapping[str, Request],
                  manager: BlockManager) -> Request | None:
    """The request whose prefill ``request`` should wait for, if any: the one it shares a
    prompt with, while there are full prompt blocks it has not computed yet."""
    source_id = request.share_prompt_with
    if source_id is None or not manager.prefix_caching:
        return None
    source = requests.get(source_id)
    if source is None or source is request or source.prompt_token_ids != request.prompt_token_ids:
        return None
    shared = shared_prompt_blocks(request, manager.block_size)
    if shared == 0 or source.num_registered_blocks >= shared:
        return None
    return source


def shared_prompt_blocks(request: Request, block_size: int) -> int:
    """Prompt blocks another request of the same prompt can take from the cache (the last
    prompt token is always computed, see ``BlockManager.match_prefix``)."""
    return (request.prompt_len - 1) // block_size
