"""The API process's half of output processing in a two-process server
(``engine_core._add_text``): text, stop strings and token counts come out as the one-process
engine makes them, from outputs that carry token ids only."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.engine.detokenizer import TextStream
from slipstream.agent.server.engine_core import _add_text

TEXT = "Once upon a time, the quick brown fox jumped over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _stream(tokenizer: Tokenizer, token_ids: list[int], stop: tuple[str, ...],
            per_output: int = 1, final_reason: str = "length",
            stop_token: bool = False) -> list[tuple[RequestOutput, bool]]:
    text = TextStream(tokenizer, [1, 2, 3], stop)
    results = []
    for start in range(0, len(token_ids), per_output):
        chunk = token_ids[start:start + per_output]
        last = start + per_output >= len(token_ids)
        output = RequestOutput("r", list(chunk), "", 3, start + len(chunk), finished=last,
                               finish_reason=final_reason if last else None,
                               stop_token=stop_token and last)
        output, stopped = _add_text(text, output)
        results.append((output, stopped))
        if output.finished:
            break
    return results


@pytest.mark.parametrize("per_output", [1, 3])
def test_stop_string_cuts_the_text_and_the_token_count(tokenizer, per_output):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    results = _stream(tokenizer, token_ids, ("quick",), per_output)
    final, stopped = results[-1]
    text = "".join(output.new_text for output, _ in results)
    assert text == TEXT[:TEXT.index("quick")]
    assert final.finished and final.finish_reason == "stop" and stopped
    emitted = sum(len(output.new_token_ids) for output, _ in results)
    assert final.num_output_tokens == emitted < len(token_ids)


def test_length_finish_flushes_everything(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    results = _stream(tokenizer, token_ids, ("never there",))
    assert "".join(output.new_text for output, _ in results) == TEXT
    assert results[-1][0].finish_reason == "length" and not results[-1][1]


def test_a_stop_token_is_not_shown(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    eos = sorted(tokenizer.eos_token_ids)[0]
    results = _stream(tokenizer, token_ids + [eos], (), final_reason="stop", stop_token=True)
    assert "".join(output.new_text for output, _ in results) == TEXT
    assert results[-1][0].finish_reason == "stop" and not results[-1][1]


def test_a_finished_grammar_shows_its_last_token(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    results = _stream(tokenizer, token_ids, (), final_reason="stop")  # no stop token
    assert "".join(output.new_text for output, _ in results) == TEXT
