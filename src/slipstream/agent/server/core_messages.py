"""The messages between the API processes and the engine-core process (engine_core.py).

Commands go from an API process to the core (``Command``); the core answers with ``Ready``
once, then ``Outputs`` after every step, ``WarmedUp``, or ``Dead``. ``SetPool`` and ``Dead``
also travel from the first API process to the others (``--api-processes``). All are msgspec
structs sent as msgpack over ZeroMQ; ``array_like`` keeps them small on the wire.
"""

from __future__ import annotations

import msgspec

from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.sampling.params import RequestOutput, SamplingParams
from slipstream.agent.engine.step.stats import EngineStats, StepSummary
from slipstream.agent.scheduler.request import RequestSLO

class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    app_id: str
    priority: int
    slo: RequestSLO | None
    kv_transfer: dict | None = None
    share_prompt_with: str | None = None
    client: int = 0  # the API process that sent it (--api-processes); its outputs go there
    share_weight: float = 1.0  # the tenant's fair share (Request.share_weight)


class Attach(msgspec.Struct, tag="attach", array_like=True):
    """Another API process (``--api-processes``), sent by the first one: take its commands
    from ``command_addr`` too, and send it a ``Ready``, then its requests' outputs and every
    step's stats and summaries at ``output_addr``."""
    client: int
    command_addr: str
    output_addr: str


class WarmUp(msgspec.Struct, tag="warm_up", array_like=True):
    pass


class CutInFlight(msgspec.Struct, tag="cut", array_like=True):
    """The drain period is over: fail every request in flight (``drained``)."""


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class DropKV(msgspec.Struct, tag="drop_kv", array_like=True):
    """Prefill role: a stop string (found here, in the API process) ended requests at their
    first token after the core had handed their KV off; free those holds."""
    transfer_ids: list[str]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_name: str
    limits: RequestLimits
    stats: EngineStats
    eos_token_ids: list[int]


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestOutput]
    stats: EngineStats
    steps: list[StepSummary]


class Dead(msgspec.Struct, tag="dead", array_like=True):
    reason: str


class WarmedUp(msgspec.Struct, tag="warmed_up", array_like=True):
    error: str | None


class SetPool(msgspec.Struct, tag="set_pool", array_like=True):
    """From the first API process to the others: label requests with this pool from now on
    (the operator moved the instance)."""
    pool: str


encoder = msgspec.msgpack.Encoder()
Command = Add | Abort | Shutdown | WarmUp | CutInFlight | DropKV | Attach
command_decoder = msgspec.msgpack.Decoder(Command)
core_decoder = msgspec.msgpack.Decoder(Ready | Outputs | Dead | WarmedUp | SetPool)
