"""Text <-> token ids for the engine, from a Hugging Face model directory.

Sits at both ends of a request: the server renders chat messages with the model's chat
template and encodes the prompt here; the engine's output processor turns sampled ids back
into text with ``IncrementalDetokenizer`` (streamed deltas that never split a UTF-8
character) and ``StopChecker`` (OpenAI stop strings, never emitted).

Only the ``tokenizers`` library and jinja2 are used, not ``transformers``; the behaviour
follows ``transformers`` 5 (``tests/unit/test_tokenizer.py`` compares them on Llama 3, Qwen2
and Mistral style directories):
only the post-processor of ``tokenizer.json`` adds BOS/EOS (transformers 5 ignores
``add_bos_token`` in ``tokenizer_config.json`` when there is a ``tokenizer.json``, and real
Llama and Mistral files carry the BOS template in it), and chat templates render in
the same sandboxed jinja2 environment with the special tokens as variables. Decoding never
applies ``clean_up_tokenization_spaces`` (lossy; ``transformers`` 5 skips it for BPE too).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

# Texts longer than this are encoded with the call that releases the GIL (see ``encode``).
_RELEASE_GIL_CHARS = 16_384
# encode_capped: texts longer than this many characters per allowed token (and at least
# _CAPPED_COUNT_MIN_CHARS long) are counted in pieces of _CAPPED_PIECE_CHARS before the exact
# encode. Real prompts run 3 to 5 characters per token.
_TYPICAL_MAX_CHARS_PER_TOKEN = 8
_CAPPED_COUNT_MIN_CHARS = 262_144
_CAPPED_PIECE_CHARS = 65_536
_CAPPED_MARGIN_TOKENS_PER_CUT = 8
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                        "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_set(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {item for item in value if isinstance(item, int)}
    return set()


def _select_chat_template(model_dir: Path, config: dict) -> str | None:
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():  # newer transformers save the template on its own
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def compile_chat_template(source: str):
    """Compile a chat template the way transformers does: an immutable sandbox (templates
    come from model hubs and are untrusted), trimmed blocks, loop controls, and the helpers
    that templates call (``raise_exception``, ``strftime_now``, a non-escaping ``tojson``)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


class Tokenizer:
    """A model's tokenizer, chat template and end-of-sequence ids."""

    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, str],
                 eos_token_ids: frozenset[int], chat_template: str | None) -> None:
        self.backend = backend
        self.special_tokens = special_tokens  # e.g. {"bos_token": "<|begin_of_text|>", ...}
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self.token_to_id(special_tokens.get("bos_token"))
        self.special_token_ids = frozenset(token_id for token_id, token
                                           in backend.get_added_tokens_decoder().items()
                                           if token.special)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: Slipstream needs the Hugging Face fast-tokenizer "
                "file tokenizer.json in the model directory (a SentencePiece tokenizer.model "
                "alone is not supported; convert it with transformers' save_pretrained)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer.json: {error}") from None
        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens = {name: content for name in _SPECIAL_TOKEN_NAMES
                          if (content := _token_content(config.get(name))) is not None}
        if config.get("split_special_tokens"):
            backend.encode_special_tokens = True

        eos_ids = _as_id_set(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
        eos_ids |= _as_id_set(_read_json(model_dir / "config.json").get("eos_token_id"))
        eos_token_id = backend.token_to_id(special_tokens.get("eos_token") or "")
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        return cls(backend, special_tokens, frozenset(eos_ids),
                   _select_chat_template(model_dir, config))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the model's post-processor
        adds (BOS for Llama 3 and Mistral, nothing for Qwen2). Special-token text in ``text``
        is parsed as the special token, as in transformers."""
        if len(text) > _RELEASE_GIL_CHARS:
            # encode() holds the GIL for the whole text; encode_batch() lets it go, so a long
            # prompt tokenized on a worker thread does not stall the event loop.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_capped(self, text: str, max_tokens: int,
                      add_special_tokens: bool = True) -> list[int] | None:
        """``encode(text)``, or None as soon as it is clear that it has more than
        ``max_tokens`` tokens. A text far longer than ``max_tokens`` tokens usually run is
        counted piece by piece first, and counting stops once past the cap, so the cost of a
        huge prompt is bounded by the cap, not by its size."""
        if self.min_num_tokens(text) > max_tokens:
            return None
        if len(text) > max(_CAPPED_COUNT_MIN_CHARS, max_tokens * _TYPICAL_MAX_CHARS_PER_TOKEN):
            # Cut at spaces, which start a word piece in byte-level BPE: the pieces' counts add
            # up to the whole's, give or take a few tokens per cut (the margin below).
            counted = 0
            start = 0
            cuts = 0
            while start < len(text):
                end = min(len(text), start + _CAPPED_PIECE_CHARS)
                if end < len(text):
                    space = text.rfind(" ", start + _CAPPED_PIECE_CHARS // 2, end)
                    end = space if space > start else end
                piece = self.backend.encode_batch([text[start:end]], add_special_tokens=False)
                counted += len(piece[0].ids)
                cuts += 1
                if counted > max_tokens + _CAPPED_MARGIN_TOKENS_PER_CUT * cuts:
                    return None
                start = end
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return ids if len(ids) <= max_tokens else None

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token can stand for, or None when that says nothing about
        the input (a normalizer may shrink the text before it is split)."""
        if self.backend.normalizer is not None:
            return None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, without encoding: each token covers at most
        ``max_token_chars`` characters. 0 when no bound is known."""
        longest = self.max_token_chars
        return 0 if not longest else -(-len(text) // longest)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _byte_level_alphabet(self) -> dict[str, int] | None:
        """For a byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM): the printable character of
        each byte -> the byte. None for other decoders (SentencePiece)."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" \
            else [decoder]
        if not any(step.get("type") == "ByteLevel" for step in steps):
            return None
        return gpt2_byte_alphabet()

    @cached_property
    def _added_token_contents(self) -> dict[int, str]:
        return {token_id: token.content
                for token_id, token in self.backend.get_added_tokens_decoder().items()}

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: a special or added token's text, a byte-level token's raw
        bytes (part of a UTF-8 character stays partial), a SentencePiece byte-fallback
        ``<0xNN>`` token's byte."""
        added = self._added_token_contents.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        alphabet = self._byte_level_alphabet
        if alphabet is not None:
            return bytes(alphabet[char] for char in piece if char in alphabet)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """The token's own text for logprobs: special tokens included (``<|im_end|>``); a
        token holding only part of a UTF-8 character is written as its bytes
        (``bytes:\\xe2\\x80``, as OpenAI does), so no two tokens share a text."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)

    @cached_property
    def _compiled_chat_template(self):
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json has no "
                             "chat_template and there is no chat_template.jinja)")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render ``messages`` as the prompt text, like transformers'
        ``apply_chat_template(tokenize=False)``. Extra keyword arguments (``tools``,
        ``documents``, ...) reach the template as variables. Raises
        ``jinja2.TemplateError`` when the template rejects the conversation."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        return self._compiled_chat_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
        """Prompt ids of a conversation. The template writes BOS itself, so no special
        tokens are added on top (as transformers does with ``tokenize=True``)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable character -> byte (``bytes_to_unicode``
    in GPT-2's encoder; every byte-level BPE vocabulary writes its tokens in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


