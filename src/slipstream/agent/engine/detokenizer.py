"""Text out of token ids as they arrive: incremental detokenization that never splits a UTF-8
character, stop strings found across token boundaries, and the stream of text deltas a
request's choices hand the API (``Tokenizer`` is in ``tokenizer.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slipstream.agent.engine.tokenizer import Tokenizer

# Prompt tokens decoded before the first generated one, so that a SentencePiece decoder
# renders that token's leading space as it would inside the text.
_DETOKENIZER_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas that are safe to stream.

    Each step decodes a short window, ``ids[window_start:]``, and compares it with the
    already emitted part of the window, ``ids[window_start:emitted_end]`` (the scheme of
    Hugging Face text-generation-inference and vLLM). Decoding a window
    instead of single tokens keeps the decoder's view of leading spaces, and holding back
    text that ends in U+FFFD waits for the rest of a multi-byte character split across
    byte-level tokens. ``flush()`` at the end of the stream emits whatever is still held
    (a sequence that never completed then shows as U+FFFD, as in a full decode).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids[-_DETOKENIZER_CONTEXT_TOKENS:])
        self._window_start = 0
        self._emitted_end = len(self._token_ids)  # window ids whose text has been emitted
        self.output_token_ids: list[int] = []
        self.text = ""  # everything emitted so far

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Feed one generated id; return the new text that can be shown now (maybe "")."""
        self._token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the stream: the held-back text, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        emitted = self._decode(self._token_ids[self._window_start:self._emitted_end])
        current = self._decode(self._token_ids[self._window_start:])
        if not final:
            grew = len(current) > len(emitted) and current.startswith(emitted)
            if not grew or current.endswith(_REPLACEMENT_CHAR):
                return ""
        delta = current[len(emitted):]
        # The next window starts where this emitted text started: a token boundary after
        # which decoding is known to be clean, with this step's tokens as context.
        self._window_start = self._emitted_end
        self._emitted_end = len(self._token_ids)
        self.text += delta
        return delta


class StopChecker:
    """OpenAI stop strings over streamed text: the output ends just before the first stop
    string, which is never emitted.

    ``feed`` holds back the longest tail of the text that could still grow into a stop
    string, so a stop string split across tokens (or across deltas) is caught before any of
    it is shown. When the stream ends for another reason, ``flush`` returns the held tail.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop_strings = tuple(dict.fromkeys(text for text in stop if text))
        self._held = ""
        self.stopped = False
        self.matched_stop: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return (text safe to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return delta, False  # the common case: nothing to hold back
        text = self._held + delta
        match = min(((text.find(stop), stop) for stop in self.stop_strings if stop in text),
                    default=None)
        if match is not None:
            self.stopped, self.matched_stop, self._held = True, match[1], ""
            return text[:match[0]], True
        hold = self._longest_tail_starting_a_stop(text)
        self._held = text[len(text) - hold:]
        return text[:len(text) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_tail_starting_a_stop(self, text: str) -> int:
        longest_stop = max((len(stop) for stop in self.stop_strings), default=0)
        for length in range(min(len(text), longest_stop - 1), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop_strings):
                return length
        return 0


class TextStream:
    """A request's output text: its detokenizer and stop strings together, fed one token at a
    time. The engine uses one per request; so does the API process of a two-process server,
    where the engine core sends token ids only."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 stop: Sequence[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stop_checker = StopChecker(stop)

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Text that can be shown after this token, and whether a stop string matched."""
        return self.stop_checker.feed(self.detokenizer.add_token(token_id))

    def flush(self) -> str:
        """The text still held back when the request ends for a reason other than a stop string."""
        text, stopped = self.stop_checker.feed(self.detokenizer.flush())
        return text if stopped else text + self.stop_checker.flush()
