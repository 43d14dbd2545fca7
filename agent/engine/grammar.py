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
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from typing import TYPE_CHECKING

import llguidance
import llguidance.torch
import torch

from slipstream.agent.engine.sampler import GrammarMasks
from slipstream.agent.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compact JSON: no optional whitespace. A model constrained to JSON cannot then spend its
# tokens on endless blank space, and the output is what json.loads sees anyway.
if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


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
    """The masks of one step's guided rows, computed on a helper thread from the moment the
    job is made. Calling it (the sampler does, after the forward) waits for them."""

    def __init__(self, pool: ThreadPoolExecutor, executor: llguidance.LLExecutor,
                 rows: list[tuple[int, llguidance.LLMatcher]], vocab_size: int) -> None:
        self._rows = rows
        self._vocab_size = vocab_size
        self._executor = executor
        self._future: Future[GrammarMasks] = pool.submit(self._compute)

    def _compute(self) -> GrammarMasks:
        bitmask = llguidance.torch.allocate_token_bitmask(len(self._rows), self._vocab_size)
        dead = [index for index, (_, matcher) in enumerate(self._rows) if matcher.is_error()]
        live = [(matcher, index) for index, (_, matcher) in enumerate(self._rows)
                if index not in dead]
        if len(live) == 1:
            llguidance.torch.fill_next_token_bitmask(live[0][0], bitmask, live[0][1])
        elif live:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, live, bitmask)
        for index, (_, matcher) in enumerate(self._rows):
            if index not in dead and matcher.is_error():  # the mask computation failed
                dead.append(index)
        for index in dead:
            bitmask[index] = -1  # sampled from anything; the row is failed anyway
        return GrammarMasks(rows=[row for row, _ in self._rows], allowed=bitmask,
                            dead_rows=[self._rows[index][0] for index in dead])

    def __call__(self) -> GrammarMasks:
        return self._future.result()


class MaskWorkers:
    """The thread and llguidance executor that compute masks beside the forward."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-masks")
        self._executor = llguidance.LLExecutor()

    def start(self, rows: list[tuple[int, llguidance.LLMatcher]]) -> MaskJob | None:
        """Start computing the masks of ``rows`` (sampler row, matcher); None if there are
        none, so a batch without grammars pays nothing."""
        if not rows:
            return None
        return MaskJob(self._pool, self._executor, rows, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

