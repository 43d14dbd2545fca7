"""Each token's own text and bytes, as logprobs report them."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "naïve café 日本語", "Emoji: 🚀👍🏽 👨‍👩‍👧", "  spaces\t\n\n", "x = [1, 2]"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(token_id) for token_id in ids) == text.encode()


def test_partial_characters_report_their_own_bytes(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # the tiny vocabulary splits the emoji's four bytes
    pieces = [tokenizer.token_bytes(token_id) for token_id in ids]
    assert all(b"\xef\xbf\xbd" not in piece for piece in pieces)  # never U+FFFD's bytes
    partial = [tokenizer.token_text(token_id) for token_id, piece in zip(ids, pieces)
               if not _is_utf8(piece)]
    assert partial and all(text.startswith("bytes:\\x") for text in partial)


def test_special_tokens_keep_their_text(tokenizer):
    for token_id in tokenizer.special_token_ids:
        content = tokenizer.backend.id_to_token(token_id)
        assert tokenizer.token_text(token_id) == content and content
        assert tokenizer.token_bytes(token_id) == content.encode()


def test_no_two_tokens_share_a_text(tokenizer):
    texts = [tokenizer.token_text(token_id) for token_id in range(tokenizer.vocab_size)]
    assert len(set(texts)) == len(texts)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
