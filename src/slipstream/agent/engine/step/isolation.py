"""Finding the request that made an engine step fail, so that only it fails.

    LLMEngine.step: runner.execute(batch) raises
        --> isolate_failures(run, chunks): re-run halves of the batch, then halves of the
            halves that fail, down to single requests
        --> tokens of every part that ran, and the requests that fail even alone

Why re-running is safe: a forward writes each chunk's KV at that chunk's own slots, so running
a chunk again writes the same values, and a chunk's attention reads only its own request's
blocks, so leaving others out of a re-run changes nothing for it. Swaps are not repeated (they
ran before the forward that failed). Unseeded random requests draw from the shared generator,
so their tokens depend on the batch anyway; greedy and seeded requests get exactly the tokens
a batch without the culprit would have given them.

With one culprit among ``n`` requests this costs about ``2 * log2(n)`` extra forwards, on
batches that halve each time. A failure that is not any request's fault (every request fails
alone) ends every request of the batch, as a failed step did before; requests outside the
batch carry on either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from slipstream.agent.engine.errors import EngineDeadError
from slipstream.agent.engine.step.batch_io import SampledToken
from slipstream.agent.scheduler.batch import ScheduledChunk

log = logging.getLogger(__name__)

# What a failed request's client is told: the cause stays in the server's log.
REQUEST_FAILED_MESSAGE = ("the engine could not process this request, so it was stopped; "
                          "other requests were not affected")

RunChunks = Callable[[tuple[ScheduledChunk, ...]], dict[str, SampledToken]]


def isolate_failures(run: RunChunks, chunks: Sequence[ScheduledChunk], error: Exception
                     ) -> tuple[dict[str, SampledToken], dict[str, str]]:
    """Run ``chunks``, which raised ``error`` together, in ever smaller groups. Returns the
    sampled tokens of the groups that ran, and ``{request_id: reason}`` for the requests that
    fail alone. ``EngineDeadError`` is never absorbed: a lost worker is not a request's fault."""
    sampled: dict[str, SampledToken] = {}
    failures: dict[str, str] = {}
    _narrow(run, tuple(chunks), error, sampled, failures)
    return sampled, failures


def _narrow(run: RunChunks, chunks: tuple[ScheduledChunk, ...], error: Exception,
            sampled: dict[str, SampledToken], failures: dict[str, str]) -> None:
    """``chunks`` failed together with ``error``: run each half, and narrow the failing ones."""
    if len(chunks) == 1:
        request_id = chunks[0].request_id
        log.error("request %s fails the engine step on its own; failing only it: %s: %s",
                  request_id, type(error).__name__, error)
        failures[request_id] = f"{type(error).__name__}: {error}"
        return
    middle = len(chunks) // 2
    for part in (chunks[:middle], chunks[middle:]):
        try:
            sampled.update(run(part))
        except EngineDeadError:
            raise
        except Exception as part_error:  # noqa: BLE001 - the culprit is in this part
            _narrow(run, part, part_error, sampled, failures)
