"""Which batches a pipelined runner (SPP) still has in flight, and whose tokens they bring.

Under SPP ``LLMEngine`` sends a batch before the previous one's tokens are back. A chunk that
samples marks its request ``in_flight`` (the scheduler leaves it alone until the token is
back) and remembers the batch that brings it. A request preempted (or finished) meanwhile
has moved on: the token that comes back belongs to a discarded past and is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.request import Request

Token = TypeVar("Token")


@dataclass
class SentBatch:
    batch: Batch
    generations: dict[str, int]  # each request's preemption count when the batch was sent
    schedule_start_s: float
    execute_start_s: float


class InFlightBatches:
    def __init__(self) -> None:
        self._sent: dict[int, SentBatch] = {}
        self._sampling_seq: dict[str, int] = {}  # request id -> seq of its next token's batch

    def sent(self, seq: int, batch: Batch, requests: Mapping[str, Request],
             schedule_start_s: float, execute_start_s: float) -> None:
        """The runner took ``batch`` as ``seq``: its sampling requests wait for their token."""
        generations = {chunk.request_id: requests[chunk.request_id].num_preemptions
                       for chunk in batch.chunks}
        self._sent[seq] = SentBatch(batch, generations, schedule_start_s, execute_start_s)
        for chunk in batch.chunks:
            if chunk.sample:
                requests[chunk.request_id].in_flight = True
                self._sampling_seq[chunk.request_id] = seq

    def returned(self, seq: int, requests: Mapping[str, Request],
                 sampled: dict[str, Token]) -> tuple[SentBatch, Batch]:
        """Batch ``seq`` is back: release its requests, drop from ``sampled`` the tokens of
        requests preempted or finished since it was sent, and return it with the part of it
        whose tokens still count."""
        sent = self._sent.pop(seq)
        current = []
        for chunk in sent.batch.chunks:
            if not chunk.sample:
                continue
            request_id = chunk.request_id
            request = requests.get(request_id)
            if self._sampling_seq.get(request_id) == seq:
                del self._sampling_seq[request_id]
                if request is not None:
                    request.in_flight = False
            # Preempted (or finished) while in flight: this token belongs to a discarded past.
            if request is not None and request.num_preemptions == sent.generations[request_id]:
                current.append(chunk)
            else:
                sampled.pop(request_id, None)
        return sent, Batch(chunks=tuple(current))
