"""``LLMEngine``'s step on a pipelined runner (SPP, ``PipelinedSteps``), and which batches
are still in flight and whose tokens they bring (``InFlightBatches``).

Under SPP the engine keeps several batches in flight: it sends a batch before the previous
one's tokens are back. A prefill chunk that samples nothing is marked computed as soon as it
is sent, so its next chunk can enter stage 1 right behind it, while a chunk that samples (the
last prefill chunk, a decode) marks its request ``in_flight`` (the scheduler leaves it alone
until the token is back) and remembers the batch that brings it. A request preempted (or
finished) meanwhile has moved on: the token that comes back belongs to a discarded past and
is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.request import Request
from slipstream.agent.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from slipstream.agent.engine.execution import BatchExecution
    from slipstream.agent.engine.step.batch_io import SampledToken
    from slipstream.agent.engine.step.runner import Runner

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


class PipelinedSteps:
    """One engine step on a pipelined runner: send a batch if the pipeline has room, then
    take the results that are back."""

    def __init__(self, runner: Runner, scheduler: Scheduler, execution: BatchExecution,
                 clock: Callable[[], float]) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.execution = execution
        self.clock = clock
        self.in_flight = InFlightBatches()
        self.ran_nothing = False  # nothing sent and nothing in flight

    def step(self) -> Iterator[tuple[SentBatch, Batch, dict[str, SampledToken]]]:
        """Each batch that is back: as sent, the part whose tokens still count, and its
        tokens. Apply each before taking the next (a request finished by one drops the
        tokens of the next)."""
        runner = self.runner
        depth = runner.pipeline_depth
        sent = False
        if runner.num_in_flight < depth:
            schedule_start_s = self.clock()
            batch = self.scheduler.schedule(schedule_start_s)
            if not batch.is_empty:
                self._dispatch(batch, schedule_start_s)
                sent = True
        self.ran_nothing = not sent and runner.num_in_flight == 0
        if runner.num_in_flight == 0:
            return
        # Wait only when nothing more could be sent; otherwise just take what has arrived.
        for seq, sampled in runner.collect(block=not sent or runner.num_in_flight >= depth):
            sent_batch, current = self.in_flight.returned(seq, self.scheduler.requests, sampled)
            yield sent_batch, current, sampled

    def _dispatch(self, batch: Batch, schedule_start_s: float) -> None:
        execute_start_s = self.clock()
        seq = self.execution.submit(batch)
        self.in_flight.sent(seq, batch, self.scheduler.requests, schedule_start_s,
                            execute_start_s)
        # A chunk that samples nothing needs no result: the next chunk may follow it now.
        advanced = tuple(chunk for chunk in batch.chunks if not chunk.sample)
        if advanced:
            self.scheduler.update(Batch(chunks=advanced), {}, self.clock())
