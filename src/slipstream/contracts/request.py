"""One request, as ``prepare()`` builds it and the engine takes it (``EngineRequest``).

    HTTP body --prepare()--> EngineRequest --in-process queue or ZeroMQ (msgspec)--> engine
        --> the scheduler's ``Request`` holds it unchanged (``Request.spec``)

Nothing copies its fields on the way: both transports carry this object, and the scheduler
reads it through ``Request``. ``kv_transfer`` is the request's part in prefill/decode
disaggregation (``KVTransfer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slipstream.contracts.sampling import SamplingParams


@dataclass(frozen=True)
class RequestSLO:
    """Per-request service-level objectives; ``None`` means "use the engine default"."""

    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True)
class KVTransfer:
    """What a request asks of prefill/decode disaggregation (the API's
    ``kv_transfer_params``). At most one side is set:

    - ``remote_decode`` (``{"do_remote_decode": true}``), to a prefill instance: compute the
      prompt and its first token, then hand the KV to a decode instance;
    - ``handle`` (the handle a prefill instance returned, sent with
      ``"do_remote_prefill": true``), to a decode instance: fetch the prompt's KV from the
      instance it names and go on decoding. The decode role parses and checks it.
    """

    remote_decode: bool = False
    handle: dict[str, Any] | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> KVTransfer | None:
        """The API's ``kv_transfer_params``; None when it asks for neither side."""
        if not params:
            return None
        if params.get("do_remote_prefill"):
            return cls(handle=params)
        if params.get("do_remote_decode"):
            return cls(remote_decode=True)
        return None


@dataclass(frozen=True)
class EngineRequest:
    """A checked request, ready for the engine. Built once, by the API's ``prepare()`` (or
    by offline callers of ``LLMEngine.add_request``), and never copied field by field."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    app_id: str = "default"  # the fair queue's application (a tenant with tenants on)
    priority: int = 0
    slo: RequestSLO | None = None  # None: the engine's defaults
    kv_transfer: KVTransfer | None = None
    # n > 1 (the API's choices): the id of a request with the same prompt added just before
    # this one; this one waits for that prefill and reuses its KV.
    share_prompt_with: str | None = None
    share_weight: float = 1.0  # the fair share of ``app_id`` (a tenant's weight)
