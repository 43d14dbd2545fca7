"""Short-prefill batching in front of the prefill queue: PLA-Serve's Adaptive Wait-Depth (AWD).

    Scheduler.add(short prompt) --> ShortPrefillHold.hold --> AdaptiveWaitDepth (awd.py)
    Scheduler.schedule(now) --> release_due(now) --> requests enter the PrefillQueue together
        --> the packer orders and packs them by policy, like any waiting request
    Scheduler.update(batch, now) --> observe_step: the released step's time becomes AWD's
        service estimate S
    engine / simulator, when a step ran nothing --> next_wakeup_s(now): sleep until then

A held request is already the scheduler's (``Scheduler.requests``, status WAITING, deadline
assigned), so ``has_unfinished`` stays true and ``finish`` can abort it; it is just not in the
queue yet. Only prompts the AWD buckets cover are held (counting only their uncached tokens),
and only on their first admission: a request preempted later goes straight back to the queue.

The released group is the unit AWD sized for one forward pass. The packer may still split it
when the iteration budget is smaller (decodes take their share first), and it will put it next
to other work; there is no padding or CUDA-graph replay of prefills here, so on this engine
AWD trades a short wait for fewer, larger prefill steps.
"""

from __future__ import annotations

from slipstream.agent.scheduler.awd import AdaptiveWaitDepth, AWDConfig, PendingPrefill
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.request import Request


class ShortPrefillHold:
    def __init__(self, config: AWDConfig, long_request_threshold_tokens: int) -> None:
        self.awd = AdaptiveWaitDepth(config)
        self.max_prompt_tokens = min(config.max_short_tokens, long_request_threshold_tokens - 1)
        self._held: dict[str, Request] = {}
        # Released requests whose first step has not been scheduled yet, and the step that
        # carries the latest released group: (its request ids, when it was scheduled).
        self._awaiting_first_step: set[str] = set()
        self._timed_step: tuple[frozenset[str], float] | None = None
        self.num_released_batches = 0

    def __len__(self) -> int:
        return len(self._held)

    def accepts(self, request: Request) -> bool:
        # A prompt whose prefix is cached is as short as its uncached rest.
        return 0 < self._uncached_tokens(request) <= self.max_prompt_tokens

    @staticmethod
    def _uncached_tokens(request: Request) -> int:
        return request.prompt_len - request.prefix_hit_tokens

    def hold(self, request: Request) -> None:
        self.awd.add(PendingPrefill(request.request_id, self._uncached_tokens(request),
                                    request.arrival_s, request.ttft_deadline_s))
        self._held[request.request_id] = request

    def remove(self, request: Request) -> bool:
        """Drop a request that finished or was aborted; True if it was still held."""
        self._awaiting_first_step.discard(request.request_id)
        if self._held.pop(request.request_id, None) is None:
            return False
        self.awd.remove(request.request_id)
        return True

    def release_due(self, now_s: float) -> list[Request]:
        """Every group AWD says is due at ``now_s``, in release order."""
        released: list[Request] = []
        while (batch := self.awd.poll(now_s)) is not None:
            self.num_released_batches += 1
            for request_id in batch.request_ids:
                released.append(self._held.pop(request_id))
                self._awaiting_first_step.add(request_id)
        return released

    def next_wakeup_s(self, now_s: float) -> float | None:
        """When a held group falls due if nothing else arrives; None when nothing is held."""
        if not self._held:
            return None
        return self.awd.next_poll_s(now_s)

    def note_scheduled(self, batch: Batch, now_s: float) -> None:
        """Start timing the step that runs the first chunks of released requests."""
        if not self._awaiting_first_step:
            return
        started = frozenset(chunk.request_id for chunk in batch.chunks
                            if chunk.request_id in self._awaiting_first_step)
        if started:
            self._awaiting_first_step -= started
            self._timed_step = (started, now_s)

    def observe_step(self, batch: Batch, now_s: float) -> None:
        """The timed step's tokens are back: its duration is AWD's service estimate S."""
        if self._timed_step is None:
            return
        request_ids, started_s = self._timed_step
        # Only a sampled chunk proves the step ran (pipelined engines update sent chunks early).
        if any(chunk.sample and chunk.request_id in request_ids for chunk in batch.chunks):
            self.awd.observe_service(now_s - started_s)
            self._timed_step = None
