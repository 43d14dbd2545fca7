"""Prefill/decode disaggregation inside one engine: the two halves of a KV hand-off.

An agent runs in one of three roles (``--role``):

- ``mixed`` (default): prefill and decode on the same instance, as always. Nothing here runs.
- ``prefill``: a request sent with ``kv_transfer_params: {"do_remote_decode": true}`` is
  prefilled, samples its first token and finishes; its KV blocks stay allocated under a
  transfer id (``KVExports``) and its output carries the handle (``KVHandle``) a decode
  instance needs. The blocks are freed when the decode instance acknowledges the transfer
  over the side channel, or when the hold times out (a decode instance that died).
- ``decode``: a request sent with ``kv_transfer_params`` = that handle (plus
  ``do_remote_prefill``) gets blocks for its prompt here, pulls the prompt's KV block by block
  on a transfer thread (``KVImports``), acknowledges, and joins the running decodes with the
  first token already generated. The engine keeps stepping its other requests meanwhile.

Both roles still serve ordinary requests: a router that falls back to one instance loses
nothing. Everything here that touches the block manager or the scheduler runs on the engine
thread; the side-channel and transfer threads only hand results over through queues.

This module holds what the role owns (``Disaggregation``); the prefill side's holds are in
``exports.py``, the decode side's imports and their transfer thread in ``imports.py``, and
the hooks the engine calls (``DisaggRole``) in ``disagg.py``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from slipstream.agent.engine.disagg_config import DisaggConfig
from slipstream.agent.engine.roles.exports import KVExports
from slipstream.agent.engine.roles.imports import KVImport, KVImports
from slipstream.agent.engine.kv.transfer.layout import KVLayout, regions_of
from slipstream.agent.engine.kv.transfer.side_channel import SideChannelClient, SideChannelServer
from slipstream.agent.engine.kv.transfer.transport import (
    KVHandle, KVTransferError, make_transport, prompt_digest)
from slipstream.agent.scheduler.block_manager import BlockManager, blocks_for_tokens
from slipstream.agent.scheduler.request import Request

log = logging.getLogger(__name__)


class Disaggregation:
    """What an engine in the prefill or decode role owns: its transport, the side channel,
    and the exports or imports in progress."""

    def __init__(self, config: DisaggConfig, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_manager: BlockManager, clock: Callable[[], float]) -> None:
        self.config = config
        self.block_manager = block_manager
        self.layout = KVLayout.of(kv_caches)
        regions = regions_of(kv_caches)
        self.exports: KVExports | None = None
        self.imports: KVImports | None = None
        self.server: SideChannelServer | None = None
        client = SideChannelClient(config.transfer_timeout_s)
        self.transport = make_transport(config.transport, self.layout, regions, config.host,
                                        side_channel=client)
        if config.role == "prefill":
            self.exports = KVExports(block_manager, config.hold_timeout_s)
            self.server = SideChannelServer(
                config.host, config.side_channel_port, self.exports.lookup,
                self.exports.release, regions if config.transport == "zmq" else None,
                progress=self.exports.progress)
        elif config.role == "decode":
            self.imports = KVImports(self.transport, client, config.blocks_per_read, clock)
        self._ids = itertools.count()
        # Prefill side: request id -> (transfer id, blocks offered so far) while it prefills.
        self._open: dict[str, tuple[str, list[int]]] = {}
        device = regions[0].device if regions else torch.device("cpu")
        self._cuda_device = device if device.type == "cuda" else None
        # Decode side, cumulative (engine thread): the metrics' source.
        self.num_completed_total = 0
        self.num_failed_total = 0
        self.num_blocks_transferred_total = 0
        self.num_blocks_cached_total = 0
        self.num_blocks_overlapped_total = 0  # read while the prefill was still running
        log.info("disaggregation: role %s, %s transport%s", config.role, self.transport.name,
                 f", side channel {self.server.address}" if self.server else "")

    # prefill side

    def open_export(self, request: Request) -> KVHandle:
        """A request to be handed off has arrived: open its hold and return the streaming
        handle a decode instance can start reading from right away."""
        assert self.exports is not None
        transfer_id = self.exports.open()
        self._open[request.request_id] = (transfer_id, [])
        return self._handle(transfer_id, request, (), -1, streaming=True)

    def publish(self, request: Request, computed_tokens: int) -> None:
        """After a step: offer the request's prompt blocks that are now full and computed
        (engine thread). The hold takes its own reference on each, so they outlive a
        preemption of the request; a recomputed request's blocks are offered only past
        those already offered."""
        entry = self._open.get(request.request_id)
        if entry is None or self.exports is None:
            return
        transfer_id, offered = entry
        full = min(computed_tokens, request.prompt_len) // self.block_manager.block_size
        new = request.block_ids[len(offered):full]
        if not new:
            return
        self._sync_device()
        self.block_manager.device.acquire(new)
        if self.exports.extend(transfer_id, new):
            offered.extend(new)
        else:  # a decode instance gave up on it already
            self.block_manager.device.free(new)
            self._open.pop(request.request_id, None)

    def export(self, request: Request, now_s: float) -> KVHandle | None:
        """The request just sampled its first token: its remaining prompt blocks (the last,
        partial one) join the hold, which closes with the first token; the hold timeout
        starts now. Returns the complete handle, or None if no decode instance wants it any
        more."""
        entry = self._open.pop(request.request_id, None)
        if entry is None or self.exports is None:
            return None
        transfer_id, offered = entry
        keep = blocks_for_tokens(request.prompt_len, self.block_manager.block_size)
        rest = request.block_ids[len(offered):keep]
        self._sync_device()
        self.block_manager.device.acquire(rest)
        first_token_id = request.output_token_ids[0]
        block_ids = self.exports.finish(transfer_id, rest, first_token_id, now_s)
        if block_ids is None:
            self.block_manager.device.free(rest)
            return None
        return self._handle(transfer_id, request, block_ids, first_token_id, streaming=False)

    def drop(self, request_id: str) -> None:
        """The request ended without a hand-off: free its hold (engine thread)."""
        entry = self._open.pop(request_id, None)
        if entry is not None and self.exports is not None:
            self.exports.drop(entry[0])

    def _handle(self, transfer_id: str, request: Request, block_ids: tuple[int, ...],
                first_token_id: int, streaming: bool) -> KVHandle:
        assert self.server is not None
        return KVHandle(
            transfer_id=transfer_id, transport=self.transport.name,
            side_channel=self.server.address, endpoint=self.transport.endpoint,
            region_addrs=self.transport.region_addrs(), layout=self.layout,
            block_ids=block_ids, num_tokens=request.prompt_len,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            first_token_id=first_token_id, streaming=streaming)

    def _sync_device(self) -> None:
        """Blocks are offered once their KV is written: wait for the device's queued work
        (a no-op on the CPU, where the forward has returned by now)."""
        if self._cuda_device is not None:
            torch.cuda.synchronize(self._cuda_device)

    # decode side

    def check_handle(self, handle: KVHandle, prompt_token_ids: list[int]) -> None:
        """ValueError (a 400) if the handle cannot belong to this prompt or this instance."""
        if handle.num_tokens != len(prompt_token_ids) or \
                handle.prompt_digest != prompt_digest(prompt_token_ids):
            raise ValueError("kv_transfer_params belongs to another prompt: send the decode "
                             "instance the same prompt as the prefill instance")
        try:
            self.transport.check_compatible(handle)
        except KVTransferError as error:
            raise ValueError(str(error)) from None

    def blocks_received(self, request_id: str) -> int | None:
        """Decode side: prompt blocks of a request in transfer that have arrived so far
        (None once it has left the transfer: joined the decodes or failed)."""
        if self.imports is None:
            return None
        item = self.imports.transferring.get(request_id)
        return None if item is None else item.blocks_read

    def poll(self, now_s: float) -> list[KVImport]:
        """Engine thread, every step: free acknowledged exports; start and collect imports."""
        if self.exports is not None:
            self.exports.reclaim(now_s)
        if self.imports is None:
            return []
        self.imports.start_transfers(self.block_manager)
        finished = self.imports.poll()
        for item in finished:
            self.num_blocks_transferred_total += item.blocks_read
            self.num_blocks_overlapped_total += item.blocks_read_early
            if item.error is not None:
                self.num_failed_total += 1
            elif not item.cancelled:
                self.num_completed_total += 1
                self.num_blocks_cached_total += item.cached_blocks
        return finished

    @property
    def num_bytes_transferred_total(self) -> int:
        return self.num_blocks_transferred_total * self.layout.bytes_per_block

    @property
    def num_pending(self) -> int:
        """Imports not yet handed to the scheduler (the engine is busy while any remain)."""
        return len(self.imports) if self.imports is not None else 0

    def close(self) -> None:
        if self.imports is not None:
            self.imports.close()
        if self.server is not None:
            self.server.close()
        self.transport.close()
