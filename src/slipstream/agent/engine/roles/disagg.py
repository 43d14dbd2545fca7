"""The prefill and decode roles (``DisaggRole``): the ``Role`` hooks (base.py) that move a
request's KV between instances; transfers.py moves the KV itself.

- Prefill role (exports): a request added with ``do_remote_decode`` gets a streaming KV
  handle at once (``admit``); every step publishes the blocks its chunks completed
  (``published``); its first token hands the KV off (``hand_off``), and a request that ends
  otherwise frees its hold (``cancel``).
- Decode role (imports): a request added with a prefill instance's handle waits outside the
  scheduler until its KV has arrived (``admit``); ``LLMEngine`` then admits it with its first
  token (``arrivals``).
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterator, Mapping
from typing import Any

from slipstream.contracts.request import KVTransfer
from slipstream.agent.engine.kv.transfer.transport import KVHandle
from slipstream.agent.engine.roles.base import check_kv_transfer
from slipstream.agent.engine.roles.imports import KVImport
from slipstream.agent.engine.roles.transfers import Disaggregation
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.request import FinishReason, Request, RequestStatus

log = logging.getLogger(__name__)


class DisaggRole:
    """The prefill or decode role, as ``LLMEngine`` calls it (``Role``)."""

    def __init__(self, disagg: Disaggregation) -> None:
        self.disagg = disagg
        self.exporting: set[str] = set()  # prefill role: requests whose KV goes elsewhere
        self.kv_handles: dict[str, dict] = {}  # their streaming handles, until they end
        self._closed = False

    def admit(self, request: Request, kv_transfer: KVTransfer | None, vocab_size: int,
              known: Container[str]) -> bool:
        disagg = self.disagg
        check_kv_transfer(kv_transfer, prefill=disagg.exports is not None,
                          decode=disagg.imports is not None)
        if kv_transfer is None:
            return False
        if kv_transfer.handle is not None:
            self._open_import(request, kv_transfer.handle, vocab_size, known)
            return True
        if kv_transfer.remote_decode:
            self._open_export(request)
        return False

    def handle_output(self, request: Request) -> RequestOutput | None:
        """Prefill role: no tokens, not finished, the streaming KV handle in
        ``kv_transfer``. It lets a router start the decode leg while the prompt computes;
        the final output still carries the complete handle (same hold)."""
        handle = self.kv_handles.get(request.request_id)
        if handle is None:
            return None
        return RequestOutput(request_id=request.request_id, new_token_ids=[], new_text="",
                             num_prompt_tokens=request.prompt_len, num_output_tokens=0,
                             kv_transfer=handle)

    @property
    def num_pending(self) -> int:
        return self.disagg.num_pending

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.disagg.close()

    # -- prefill role ---------------------------------------------------------------------

    def _open_export(self, request: Request) -> None:
        self.exporting.add(request.request_id)
        self.kv_handles[request.request_id] = self.disagg.open_export(request).to_json()

    def published(self, batch: Batch, failures: Container[str],
                requests: Mapping[str, Request]) -> None:
        """The blocks each handed-off prompt completed in this step become readable by its
        decode instance while the next chunks compute."""
        if not self.exporting:
            return
        for chunk in batch.chunks:
            if chunk.request_id in self.exporting and chunk.request_id not in failures:
                request = requests.get(chunk.request_id)
                if request is not None:
                    self.disagg.publish(request, chunk.end_pos)

    def hand_off(self, request: Request, now: float, reason: FinishReason | None
                 ) -> tuple[dict[str, Any] | None, FinishReason | None]:
        """The first token ends a handed-off request here. Unless it already ended the
        request (``reason``), its KV goes to a decode instance, which continues from it:
        returns the handle for the final output, and why the request ends here."""
        if request.request_id not in self.exporting:
            return None, reason
        kv_transfer = None
        if reason is None:
            handle = self.disagg.export(request, now)
            kv_transfer = handle.to_json() if handle is not None else None
            # No handle: the decode side gave up on this hand-off mid-prompt (it
            # acknowledged early). Not a natural end either, so a router does not
            # mistake the first token for the whole answer.
            reason = FinishReason.LENGTH if handle is not None else FinishReason.ABORT
        self._end_export(request.request_id)
        return kv_transfer, reason

    def _end_export(self, request_id: str) -> None:
        """The request ends here; a hold it did not hand off is freed."""
        if request_id in self.exporting:
            self.exporting.discard(request_id)
            self.kv_handles.pop(request_id, None)
            self.disagg.drop(request_id)  # a no-op once exported

    def drop_kv(self, transfer_id: str) -> None:
        """Free a hold handed off already; a decode instance reading it is told it is gone."""
        if self.disagg.exports is not None:
            self.disagg.exports.drop(transfer_id)

    # -- decode role ----------------------------------------------------------------------

    def _open_import(self, request: Request, kv_transfer: dict[str, Any], vocab_size: int,
                     known: Container[str]) -> None:
        """Fetch the prompt's KV from the prefill instance named in the handle; ValueError
        for a handle that cannot serve this request. ``known``: the request ids in use."""
        imports = self.disagg.imports
        assert imports is not None  # admit() checked the role
        handle = KVHandle.from_json(kv_transfer)
        self.disagg.check_handle(handle, request.prompt_token_ids)
        if handle.first_token_id >= vocab_size:
            raise ValueError("kv_transfer_params.first_token_id is outside the vocabulary")
        if request.request_id in known:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        # The first token joins the output once the KV is here (a streaming handle learns
        # it only then).
        request.num_computed_tokens = request.prompt_len
        imports.add(KVImport(request, handle))

    def arrivals(self, now: float, vocab_size: int,
                 waiting: Container[str]) -> Iterator[tuple[Request, bool]]:
        """Free acknowledged exports, then each import that ended since the last poll, in
        order, with whether its KV arrived. An arrived request holds its blocks and its first
        token; a failed one is finished with an error, its blocks freed. Cancelled imports,
        and those no longer ``waiting`` (request ids), free their blocks and are left out."""
        block_manager = self.disagg.block_manager
        for item in self.disagg.poll(now):
            request = item.request
            request.block_ids = item.block_ids
            if item.cancelled or request.request_id not in waiting:
                block_manager.release(request.block_ids)
                continue
            if item.error is None and not 0 <= item.first_token_id < vocab_size:
                item.error = f"first token {item.first_token_id} is outside the vocabulary"
            if item.error is not None:
                log.error("request %s: KV transfer failed: %s", request.request_id, item.error)
                block_manager.release(request.block_ids)
                request.status = RequestStatus.FINISHED
                request.finish_reason = FinishReason.ERROR
                yield request, False
                continue
            request.output_token_ids.append(item.first_token_id)
            yield request, True

    def cancel(self, request_id: str) -> Request | None:
        """Stop waiting for a request's KV (its blocks are freed when its transfer ends) and
        return it; None if it is not waiting here, after freeing a hold it did not hand
        off."""
        item = self.disagg.imports.cancel(request_id) if self.disagg.imports else None
        if item is not None:
            return item.request
        self._end_export(request_id)
        return None

    # -- both -----------------------------------------------------------------------------

    def transfer_stats(self) -> dict[str, int]:
        """The KV transfer counters of ``EngineStats``."""
        disagg = self.disagg
        exports = disagg.exports
        return {
            "kv_transfers_acknowledged": exports.num_released_total if exports is not None else 0,
            "kv_transfers_expired": exports.num_expired_total if exports is not None else 0,
            "kv_transfers_completed": disagg.num_completed_total,
            "kv_transfers_failed": disagg.num_failed_total,
            "kv_transfer_blocks": disagg.num_blocks_transferred_total,
            "kv_transfer_cached_blocks": disagg.num_blocks_cached_total,
            "kv_transfer_bytes": disagg.num_bytes_transferred_total,
            "kv_transfer_overlapped_blocks": disagg.num_blocks_overlapped_total,
        }
