"""Grammar-constrained decoding with llguidance: a grammar per request, token masks per step.

    server: response_format / forced tool call -> llguidance grammar text (server/structured.py)
        -> SamplingParams.grammar -> engine.add_request: a ``Matcher`` for the request
    each step: ``MaskJob`` fills the guided rows' masks on a helper thread while the model's
        forward runs -> the sampler waits for them, masks the logits, samples
        -> engine: each matcher consumes its request's token; a finished grammar ends the
           request (finish_reason "stop")

llguidance (the grammar engine behind Guidance, also used by vLLM, SGLang and llama.cpp)
compiles JSON schemas and Lark grammars itself and computes a mask in tens of microseconds;
its mask computation releases the GIL, so the helper thread runs beside the forward rather
than after it. Masks are int32 bitmasks (bit ``t % 32`` of word ``t // 32`` allows token t),
copied to the device and unpacked there by the sampler.

The helper thread fills the rows one after another, and the sampler takes over the rows it
has not reached when the forward ends (``MaskJob``). llguidance's thread pool
(``fill_next_token_bitmask_par``) is used only for large batches on hosts with many cores
(``PARALLEL_MIN_ROWS``, ``PARALLEL_MIN_CPUS``): beside a CPU forward on a 2-core host, 8 rows
took 9-11 ms through the pool against 0.6 ms filled in turn, as the pool's threads fought
the forward for the cores (docs/api.md, "Structured outputs: cost").
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING

import llguidance

from slipstream.agent.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from slipstream.agent.engine.sampling.sampler import GrammarMasks

log = logging.getLogger(__name__)

# Compact JSON: no optional whitespace. A model constrained to JSON cannot then spend its
# tokens on endless blank space, and the output is what json.loads sees anyway.
if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}

# Below this many guided rows, or on a host with fewer usable cores, the helper thread fills
# the masks itself instead of through llguidance's thread pool.
PARALLEL_MIN_ROWS = 32
PARALLEL_MIN_CPUS = 8


def json_schema_grammar(schema: dict) -> str:
    """llguidance grammar text for a JSON schema (not yet checked: see ``check``)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarCompiler:
    """llguidance's view of the model's tokenizer (built on first use, ~0.1-1 s for a large
    vocabulary) and the checks and matchers made with it. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(set(eos_token_ids))
        self._lock = threading.Lock()

    @cached_property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            return llguidance.LLTokenizer(self._tokenizer.backend.to_str(),
                                          eos_token=self._eos or None)

    def check(self, grammar: str) -> str | None:
        """Why llguidance cannot use ``grammar`` (its message names the schema keyword or
        the grammar rule at fault), or None when it can."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.lltokenizer)
        return messages[0] if is_error else None

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher at the grammar's start; ValueError if the grammar is unusable."""
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar is invalid: {matcher.get_error()}")
        return matcher


class MaskJob:
    """The masks of one step's guided rows. A helper thread starts filling them, row by row,
    the moment the job is made, so they are computed while the forward runs. Calling the job
    (the sampler does, after the forward) fills the rows the helper has not taken yet itself,
    then waits only for the rows the helper is filling at that moment: on a busy host, where
    the helper thread may not get a core during the forward, the sampler never waits for the
    thread to be scheduled, only for work in progress.

    Each row is written straight into ``bitmask`` (a buffer ``MaskWorkers`` reuses) through
    llguidance's pointer call, which computes with the GIL released; per row the Python side
    is a claim and one call, so the two threads hardly contend for the GIL."""

    def __init__(self, rows: list[tuple[int, llguidance.LLMatcher]], bitmask: torch.Tensor,
                 executor: llguidance.LLExecutor | None = None) -> None:
        self._rows = rows
        self._bitmask = bitmask
        self._row_bytes = bitmask.shape[1] * bitmask.element_size()
        self._base = bitmask.data_ptr()
        # llguidance's thread pool, for large batches only (PARALLEL_MIN_ROWS).
        self._executor = executor if len(rows) >= PARALLEL_MIN_ROWS else None
        self._lock = threading.Lock()
        self._all_done = threading.Condition(self._lock)
        self._next = 0  # rows [0, _next) are taken (by the helper or the sampler)
        self._done = 0
        self._error: BaseException | None = None

    def _take(self, count: int) -> range:
        """Claim up to ``count`` of the rows nobody has taken yet."""
        with self._lock:
            first = self._next
            self._next = min(len(self._rows), first + count)
            return range(first, self._next)

    def _fill(self, indices: range) -> None:
        try:
            if self._executor is not None and len(indices) > 1:
                live = [(self._rows[index][1], index) for index in indices
                        if not self._rows[index][1].is_error()]
                self._executor.unsafe_compute_mask_ptr(live, self._base, self._row_bytes,
                                                       len(self._rows))
            else:
                rows, base, size = self._rows, self._base, self._row_bytes
                for index in indices:
                    matcher = rows[index][1]
                    if not matcher.is_error():  # the call releases the GIL while it computes
                        matcher.unsafe_compute_mask_ptr(base + index * size, size)
        except BaseException as error:  # handed to the sampler
            self._error = self._error or error
        finally:
            with self._lock:
                self._done += len(indices)
                if self._done == len(self._rows):
                    self._all_done.notify_all()

    def help(self) -> None:
        """The helper thread: every row with the thread pool, else one row at a time."""
        chunk = len(self._rows) if self._executor is not None else 1
        while indices := self._take(chunk):
            self._fill(indices)

    def wait(self) -> None:
        """Fill the rows nobody has taken, then wait for those in progress."""
        while indices := self._take(1):
            self._fill(indices)
        with self._lock:
            while self._done < len(self._rows):
                self._all_done.wait()

    def __call__(self) -> GrammarMasks:
        from slipstream.agent.engine.sampling.sampler import GrammarMasks

        self.wait()
        if self._error is not None:
            raise self._error
        dead = [index for index, (_, matcher) in enumerate(self._rows) if matcher.is_error()]
        for index in dead:
            self._bitmask[index] = -1  # sampled from anything; the row is failed anyway
        return GrammarMasks(rows=[row for row, _ in self._rows], allowed=self._bitmask,
                            dead_rows=[self._rows[index][0] for index in dead])


class MaskWorkers:
    """The helper thread (and, on large hosts, llguidance's executor) that compute masks
    beside the forward, and the bitmask buffers they write: two, used in turn and grown when
    a batch has more guided rows, so a step allocates nothing and the previous step's masks
    are never overwritten while a sampler may still read them."""

    def __init__(self, vocab_size: int, cpus: int | None = None) -> None:
        # torch only here, where masks are made (the engine's side): the API process of a
        # two-process server checks grammars with this module and never imports torch.
        import torch

        self.vocab_size = vocab_size
        self._jobs: queue.SimpleQueue[MaskJob | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="slipstream-masks",
                                        daemon=True)
        self._thread.start()
        cpus = cpus if cpus is not None else _usable_cpus()
        self._executor = llguidance.LLExecutor() if cpus >= PARALLEL_MIN_CPUS else None
        self._buffers: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
        self._turn = 0
        self._last: MaskJob | None = None

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.help()

    def _bitmask(self, rows: int) -> torch.Tensor:
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < rows:
            import llguidance.torch

            buffer = llguidance.torch.allocate_token_bitmask(max(rows, 2 * buffer.shape[0]),
                                                             self.vocab_size)
            self._buffers[self._turn] = buffer
        return buffer[:rows]

    def start(self, rows: list[tuple[int, llguidance.LLMatcher]]) -> MaskJob | None:
        """Start computing the masks of ``rows`` (sampler row, matcher); None if there are
        none, so a batch without grammars pays nothing."""
        if self._last is not None:  # its matchers may be this job's: never fill one twice
            self._last.wait()
            self._last = None
        if not rows:
            return None
        job = MaskJob(rows, self._bitmask(len(rows)), self._executor)
        self._last = job
        self._jobs.put(job)
        return job

    def close(self) -> None:
        if self._last is not None:
            self._last.wait()
        self._jobs.put(None)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
