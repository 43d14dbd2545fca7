"""The messages between the API processes and the engine-core process (engine_core.py).

Commands go from an API process to the core: the loop's own (``Add`` with the request as
``prepare()`` built it, ``Abort``, ... from engine_loop.py, which the in-process transport
queues as they are) and ``Attach``. The core answers with ``Ready`` once, then ``Outputs``
after every step, ``WarmedUp``, or ``Dead``. ``SetPool`` and ``Dead`` also travel from the
first API process to the others (``--api-processes``). All are msgspec structs sent as
msgpack over ZeroMQ; ``array_like`` keeps them small on the wire.
"""

from __future__ import annotations

import msgspec

from slipstream.agent.engine.engine_loop import Command
from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.step.stats import EngineStats, StepSummary


class Attach(msgspec.Struct, tag="attach", array_like=True):
    """Another API process (``--api-processes``), sent by the first one: take its commands
    from ``command_addr`` too, and send it a ``Ready``, then its requests' outputs and every
    step's stats and summaries at ``output_addr``."""
    client: int
    command_addr: str
    output_addr: str


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
WireCommand = Command | Attach
command_decoder = msgspec.msgpack.Decoder(WireCommand)
core_decoder = msgspec.msgpack.Decoder(Ready | Outputs | Dead | WarmedUp | SetPool)
