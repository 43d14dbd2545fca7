"""Running a scheduled batch on the runner, for ``LLMEngine`` (``BatchExecution``).

    Batch --mask_job()--> grammar masks of its guided rows, computed while it runs
          --execute()--> runner.execute(batch, masks) -> sampled tokens
             a lower KV tier that failed to load -> recompute those requests, run the rest
             any other error -> find the requests that make it fail (isolation.py)
          --submit()--> runner.submit(batch, masks) (pipelined runners: SPP)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import llguidance

from slipstream.agent.engine.errors import EngineDeadError, KVTierLoadError
from slipstream.agent.engine.sampling.grammar import MaskJob, MaskWorkers
from slipstream.agent.engine.step.isolation import isolate_failures
from slipstream.agent.engine.step.batch_io import SampledToken
from slipstream.agent.engine.step.runner import Runner
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class BatchExecution:
    def __init__(self, runner: Runner, scheduler: Scheduler, vocab_size: int,
                 matcher_of: Callable[[str], llguidance.LLMatcher | None],
                 clock: Callable[[], float]) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self._vocab_size = vocab_size
        self._matcher_of = matcher_of  # a request's grammar matcher, if it has one
        self._clock = clock
        self._mask_workers: MaskWorkers | None = None  # started with the first grammar

    def execute(self, batch: Batch) -> tuple[dict[str, SampledToken], dict[str, str]]:
        """Run the batch; if it raises, find the requests that make it fail (isolation.py).
        Returns the sampled tokens and ``{request_id: why}`` for requests to fail alone."""
        try:
            sampled = self._run(batch)
            failures: dict[str, str] = {}
        except KVTierLoadError as error:
            # Their KV did not arrive: recompute them, run the rest as it was.
            dropped = set(self.scheduler.recompute_after_failed_load(error.device_blocks,
                                                                     self._clock()))
            log.warning("%s; recomputing %d requests instead", error, len(dropped))
            rest = tuple(chunk for chunk in batch.chunks if chunk.request_id not in dropped)
            return self.execute(Batch(chunks=rest)) if rest else ({}, {})
        except EngineDeadError:
            raise
        except Exception as error:  # noqa: BLE001 - find the culprit, spare the rest
            log.warning("an engine step of %d requests failed (%s: %s); looking for the "
                        "request that causes it", len(batch.chunks), type(error).__name__, error)
            sampled, failures = isolate_failures(
                lambda chunks: self._run(Batch(chunks=chunks)), batch.chunks, error)
        return sampled, failures

    def submit(self, batch: Batch) -> int:
        """Send the batch to a pipelined runner; returns its sequence number."""
        masks = self.mask_job(batch.chunks)
        return self.runner.submit(batch) if masks is None else self.runner.submit(batch, masks)

    def _run(self, batch: Batch) -> dict[str, SampledToken]:
        """Execute one batch; the masks of its guided rows are computed while it runs."""
        masks = self.mask_job(batch.chunks)
        if masks is None:
            return self.runner.execute(batch)
        return self.runner.execute(batch, masks)

    def mask_job(self, chunks: Sequence[ScheduledChunk]) -> MaskJob | None:
        """Start the grammar masks of the chunks that sample under a grammar; their rows
        are their places among the sampling chunks, as the runner orders them."""
        rows = []
        row = 0
        for chunk in chunks:
            if not chunk.sample:
                continue
            if chunk.sampling.guided:
                matcher = self._matcher_of(chunk.request_id)
                if matcher is not None:
                    rows.append((row, matcher))
            row += 1
        if not rows:
            return None
        if self._mask_workers is None:
            self._mask_workers = MaskWorkers(self._vocab_size)
        return self._mask_workers.start(rows)

    def close(self) -> None:
        if self._mask_workers is not None:
            self._mask_workers.close()
