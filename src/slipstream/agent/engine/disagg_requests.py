"""``LLMEngine``'s per-request side of prefill/decode disaggregation (disagg.py moves the KV).

- Prefill role (exports): a request added with ``do_remote_decode`` gets a streaming KV
  handle at once (``open_export``); every step publishes the blocks its chunks completed
  (``publish``); its first token hands the KV off (``hand_off``), and a request that ends
  otherwise frees its hold (``end_export``).
- Decode role (imports): a request added with a prefill instance's handle waits outside the
  scheduler until its KV has arrived (``open_import``); ``LLMEngine`` then admits it with its
  first token.

Imports nothing heavy at run time: the engine builds ``Disaggregation`` (zmq, transfer
engines) only in a prefill or decode role.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterator, Mapping
from typing import TYPE_CHECKING

from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from slipstream.agent.engine.disagg import Disaggregation
    from slipstream.agent.engine.disagg_imports import KVImport

log = logging.getLogger(__name__)


def require(requests: DisaggRequests | None, flag: str, role: str) -> DisaggRequests:
    """The engine's disaggregation side, or a ValueError for a request that asks for
    ``flag`` (``kv_transfer_params``) from an instance not in ``role``."""
    if requests is None or (requests.disagg.exports if role == "prefill"
                            else requests.disagg.imports) is None:
        raise ValueError(f"kv_transfer_params.{flag} needs a {role} instance "
                         f"(slipstream serve --role {role})")
    return requests


class DisaggRequests:
    def __init__(self, disagg: Disaggregation) -> None:
        self.disagg = disagg
        self.exporting: set[str] = set()  # prefill role: requests whose KV goes elsewhere
        self.kv_handles: dict[str, dict] = {}  # their streaming handles, until they end

    # -- prefill role ---------------------------------------------------------------------

    def open_export(self, request: Request) -> None:
        self.exporting.add(request.request_id)
        self.kv_handles[request.request_id] = self.disagg.open_export(request).to_json()

    def publish(self, batch: Batch, failures: Container[str],
                requests: Mapping[str, Request]) -> None:
        """The blocks each handed-off prompt completed in this step become readable by its
        decode instance while the next chunks compute."""
        for chunk in batch.chunks:
            if chunk.request_id in self.exporting and chunk.request_id not in failures:
                request = requests.get(chunk.request_id)
                if request is not None:
                    self.disagg.publish(request, chunk.end_pos)

    def hand_off(self, request: Request, now: float, reason: FinishReason | None
                 ) -> tuple[dict | None, FinishReason]:
        """The first token ends the request here. Unless it already ended the request
        (``reason``), its KV goes to a decode instance, which continues from it: returns the
        handle for the final output, and why the request ends here."""
        kv_transfer = None
        if reason is None:
            handle = self.disagg.export(request, now)
            kv_transfer = handle.to_json() if handle is not None else None
            # No handle: the decode side gave up on this hand-off mid-prompt (it
            # acknowledged early). Not a natural end either, so a router does not
            # mistake the first token for the whole answer.
            reason = FinishReason.LENGTH if handle is not None else FinishReason.ABORT
        self.end_export(request.request_id)
        return kv_transfer, reason

    def end_export(self, request_id: str) -> None:
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

    def open_import(self, request: Request, kv_transfer: dict, vocab_size: int,
                    known: Container[str]) -> None:
        """Fetch the prompt's KV from the prefill instance named in the handle; ValueError
        for a handle that cannot serve this request. ``known``: the request ids in use."""
        from slipstream.agent.engine.disagg_imports import KVImport
        from slipstream.agent.engine.kv.transfer.transport import KVHandle

        imports = self.disagg.imports
        assert imports is not None  # require(..., "decode")
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

    def cancel_import(self, request_id: str) -> KVImport | None:
        """Stop waiting for a request's KV; None if it is not waiting here. Its blocks are
        freed when its transfer ends."""
        if self.disagg.imports is None:
            return None
        return self.disagg.imports.cancel(request_id)

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
