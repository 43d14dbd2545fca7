"""The engine's own host work per step, which the layer tables and the runner fit do not see.

    profile dir (tables + runner overhead) --> LLMEngine (offline, no server) on a synthetic
        serving load --> per step: wall time of LLMEngine.step() and of the ModelRunner
        execution inside it (the on_step hook) --> host = step - execute
        --> fit host = a + b * sequences --> profile.json host_overhead_ms, host_per_sequence_ms
        --> fit execute - tables = a + b * sequences + c * prefill tokens
            --> iteration_overhead_ms, per_sequence_overhead_ms, per_prefill_token_overhead_ms

A step is schedule, execute, request-state update and output processing (detokenization,
stop checks, building the streamed output), plus the ``stats()`` snapshot that the serving
loop (``AsyncEngine``) takes after every step. On a small model on a CPU that host work is a
large share of a step, and the simulator advances its clock by the predicted step, so it must
be in the profile. What runs outside ``step()`` in a live server (the HTTP/SSE handlers that
share the GIL with the engine thread) is not measured here: it depends on the server, the
client and the machine, not on the engine.

The requests decode greedily, the sampler's common path, as the live comparisons do (the
OpenAI benches, ``moe_bench``). A temperature draw costs a multinomial over the vocabulary per
row on top, which the profile does not hold: on one CPU core 0.08 ms per row at a 4K
vocabulary and 0.9 ms at 32K (32 rows, best of 30). Calibrated at the API's default
temperature 1, that draw went into the fitted per-sequence overhead, and the predictor charged
it to greedy steps: the ~100M dense preset fitted 1.8 ms per sequence.

The load comes in waves of concurrent requests of random prompt and output lengths, so the
batches cover one to ``max(waves)`` sequences, decodes next to prefill chunks, as the packer
forms them under its time budget.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.profile.fit import fit_overhead, fit_overhead_with_prefill
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.step.stats import StepStats
from slipstream.agent.scheduler.batch import Batch

DEFAULT_WAVES = (1, 4, 12, 32)
MAX_IDLE_STEPS = 1000


@dataclass(frozen=True)
class CalibrationLoad:
    """Requests of one calibration run; lengths are drawn uniformly in the given ranges."""

    waves: tuple[int, ...] = DEFAULT_WAVES  # concurrent requests per wave
    prompt_tokens: tuple[int, int] = (16, 400)
    output_tokens: tuple[int, int] = (8, 48)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.waves or min(self.waves) < 1:
            raise ValueError("waves must be positive request counts")
        for low, high in (self.prompt_tokens, self.output_tokens):
            if not 1 <= low <= high:
                raise ValueError("length ranges must satisfy 1 <= low <= high")


@dataclass(frozen=True)
class StepTiming:
    sequences: int  # chunks in the batch (decodes and prefill chunks)
    step_ms: float  # the whole LLMEngine.step(), and the stats() snapshot after it
    execute_ms: float  # ModelRunner.execute() inside it
    batch: Batch | None = None  # what ran, for fits against the tables' prediction

    @property
    def host_ms(self) -> float:
        return self.step_ms - self.execute_ms


def time_engine_steps(engine: LLMEngine, load: CalibrationLoad,
                      tokens_salt: int = 0) -> list[StepTiming]:
    """Run ``load`` to completion on ``engine`` and time every step that ran a batch.

    The requests' lengths come from ``load.seed`` alone and their tokens also from
    ``tokens_salt``: a run with another salt forms the same batches (the same shapes to warm
    up) from prompts the prefix cache has not seen."""
    rng = np.random.default_rng(load.seed)
    tokens_rng = np.random.default_rng([load.seed, tokens_salt])
    vocab = engine.model_config.vocab_size
    executed: list[StepStats] = []
    previous_hook = engine.on_step
    engine.on_step = executed.append
    timings: list[StepTiming] = []
    gc.collect()  # as AsyncEngine does before serving: no collector pauses from setup garbage
    try:
        for wave in load.waves:
            for _ in range(wave):
                prompt = tokens_rng.integers(10, vocab, int(rng.integers(
                    load.prompt_tokens[0], load.prompt_tokens[1] + 1)))
                max_tokens = int(rng.integers(load.output_tokens[0], load.output_tokens[1] + 1))
                engine.add_request(prompt.tolist(), SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            idle_steps = 0
            while engine.has_unfinished():
                executed.clear()
                started = time.perf_counter()
                engine.step()
                engine.stats()  # the serving loop (AsyncEngine) snapshots after every step
                step_ms = (time.perf_counter() - started) * 1000
                if not executed:
                    idle_steps += 1
                    if idle_steps > MAX_IDLE_STEPS:
                        raise RuntimeError("the scheduler packs nothing: one minimum prefill "
                                           "chunk is predicted over the batch-time target")
                    continue
                idle_steps = 0
                stats = executed[-1]
                timings.append(StepTiming(len(stats.batch.chunks), step_ms,
                                          stats.execute_s * 1000, stats.batch))
    finally:
        engine.on_step = previous_hook
    return timings


def fastest_steps(runs: Sequence[Sequence[StepTiming]]) -> list[StepTiming]:
    """Step by step, the fastest of runs that formed the same batches (the same load with
    other prompt tokens, ``tokens_salt``): another process on a shared machine only ever adds
    time, to some steps of one run, and a fit through every step of a loaded run reads that
    as overhead growing with the batch. Runs whose batches differ anywhere are pooled."""
    first = runs[0]
    if any(len(run) != len(first) or any(_shape(a) != _shape(b) for a, b in zip(run, first))
           for run in runs[1:]):
        return [timing for run in runs for timing in run]
    return [min(steps, key=lambda timing: timing.step_ms) for steps in zip(*runs)]


def _shape(timing: StepTiming) -> tuple[int | tuple[int, int], ...]:
    """The step's sequences and, where known, its chunks' tokens and KV lengths after them,
    in any order (the packer's order of equal requests may differ between runs)."""
    chunks = timing.batch.chunks if timing.batch is not None else ()
    return (timing.sequences, *sorted((c.num_tokens, c.end_pos) for c in chunks))


def fit_host_overhead(timings: Sequence[StepTiming]) -> tuple[float, float]:
    """``host_ms = fixed + per_sequence * sequences``, robust to steps slowed by other work."""
    if len(timings) < 2:
        raise ValueError("need at least two timed steps to fit the host overhead")
    return fit_overhead([t.sequences for t in timings], [t.host_ms for t in timings])


def fit_runner_overhead(timings: Sequence[StepTiming], tables_ms: Callable[[Batch], float],
                        extra: Sequence[tuple[int, int, float]] = ()
                        ) -> tuple[float, float, float]:
    """``execute_ms - tables_ms(batch) = fixed + per_sequence * sequences + per_token *
    prefill tokens`` (``fit_overhead_with_prefill``) over the steps the
    engine really ran (decodes of uneven KV lengths next to prefill chunks, which the tables'
    uniform grid does not reproduce: the torch backend pads decodes within a group of similar
    KV lengths), plus
    ``extra`` (sequences, prefill tokens, residual ms) samples measured elsewhere."""
    batches = [t.batch for t in timings if t.batch is not None]
    if len(timings) < 2 or len(batches) < len(timings):
        raise ValueError("need at least two timed steps with their batches")
    samples = [(t.sequences, prefill_tokens(batch), t.execute_ms - tables_ms(batch))
               for t, batch in zip(timings, batches)]
    samples += list(extra)
    return fit_overhead_with_prefill([n for n, _, _ in samples], [p for _, p, _ in samples],
                                     [ms for _, _, ms in samples])


def prefill_tokens(batch: Batch) -> int:
    """Tokens of the batch's prefill chunks (a decode is a chunk of one token)."""
    return sum(chunk.num_tokens for chunk in batch.chunks if chunk.num_tokens > 1)
