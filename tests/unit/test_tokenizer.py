"""The tokenizer wrapper against transformers' AutoTokenizer, on the tiny model's Llama 3
style tokenizer and on Qwen2-style and Mistral-style tokenizer directories built here."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from slipstream.agent.engine.models.tiny_corpus import training_corpus
from slipstream.agent.engine.models.tiny_model import build_tokenizer
from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.engine.detokenizer import IncrementalDetokenizer, StopChecker

SAMPLE_TEXTS = [
    "Hello, world!",
    "The river ran quietly past the old mill.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "naïve café, Straße, Москва, 東京, 서울, العربية",
    "emoji 😀🚀👋🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "numbers 1234567 3.14159 -42 1e-9",
    "code: def f(x):\n    return x ** 2  # square",
    "",
    " ",
    "<|start_header_id|>user<|end_header_id|> special text inside",
    "zzzqqqxxx unseenwordsꙮ𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2+2?  "},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+3? 🤔"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                  {"type": "text", "text": "part two"}]}],
]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% else %}{{ raise_exception('only user and assistant"
    " roles are supported') }}{% endif %}{% endfor %}")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture(scope="session")
def qwen_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level BPE with no BOS, ChatML specials and two end-of-sequence ids."""
    model_dir = tmp_path_factory.mktemp("qwen-style")
    backend = build_tokenizer(1024)
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.save(str(model_dir / "tokenizer.json"))
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE})
    _write_json(model_dir / "generation_config.json", {
        "eos_token_id": [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]})
    return model_dir


@pytest.fixture(scope="session")
def mistral_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SentencePiece-style metaspace BPE; BOS from the post-processor, as Mistral's files do."""
    model_dir = tmp_path_factory.mktemp("mistral-style")
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    backend.train_from_iterator(training_corpus(num_made_up_words=2000), trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    backend.save(str(model_dir / "tokenizer.json"))
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": {
            "__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True},
        "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "chat_template": MISTRAL_TEMPLATE})
    _write_json(model_dir / "config.json", {"eos_token_id": 2, "bos_token_id": 1})
    return model_dir


@pytest.fixture(scope="session", params=["llama3", "qwen2", "mistral"])
def model_dir(request, tiny_model_dir: Path) -> Path:
    name_to_fixture = {"llama3": "tiny_model_dir", "qwen2": "qwen_style_dir",
                       "mistral": "mistral_style_dir"}
    return request.getfixturevalue(name_to_fixture[request.param])


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def _hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_encode_and_decode_match_transformers(model_dir: Path) -> None:
    ours, theirs = Tokenizer.from_dir(model_dir), _hf_tokenizer(model_dir)
    assert ours.vocab_size == len(theirs)
    for text in SAMPLE_TEXTS:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip), text


def test_bos_is_added_the_way_each_model_family_does(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    ids = tokenizer.encode("hello")
    if tokenizer.bos_token_id is None:  # Qwen2 style
        assert ids == tokenizer.encode("hello", add_special_tokens=False)
    else:
        assert ids[0] == tokenizer.bos_token_id
        assert ids[1:] == tokenizer.encode("hello", add_special_tokens=False)


def test_chat_template_matches_transformers(model_dir: Path) -> None:
    ours, theirs = Tokenizer.from_dir(model_dir), _hf_tokenizer(model_dir)
    conversations = CONVERSATIONS
    if "qwen" in model_dir.name:  # its template takes string contents only
        conversations = CONVERSATIONS[:2]
    if "mistral" in model_dir.name:  # its template takes plain user/assistant turns only
        conversations = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                          {"role": "user", "content": "Bye 👋"}]]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = theirs.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt) == expected
            expected_ids = theirs.apply_chat_template(
                messages, tokenize=True, return_dict=False,
                add_generation_prompt=add_generation_prompt)
            assert ours.encode_chat(messages, add_generation_prompt) == list(expected_ids)


def test_llama3_chat_prompt_shape_and_eos_ids(tiny_tokenizer: Tokenizer) -> None:
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": " Hi "}])
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tiny_tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids.count(tiny_tokenizer.bos_token_id) == 1
    expected_eos = {tiny_tokenizer.token_to_id("<|eot_id|>"),
                    tiny_tokenizer.token_to_id("<|end_of_text|>")}
    assert tiny_tokenizer.eos_token_ids == expected_eos
    assert tiny_tokenizer.vocab_size == 4096


def test_eos_ids_come_from_every_config_file(qwen_style_dir: Path, mistral_style_dir: Path) -> None:
    qwen = Tokenizer.from_dir(qwen_style_dir)
    assert qwen.eos_token_ids == {qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")}
    assert Tokenizer.from_dir(mistral_style_dir).eos_token_ids == {2}


def test_template_errors_surface_as_template_errors(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="unknown chat role: wizard"):
        tiny_tokenizer.apply_chat_template([{"role": "wizard", "content": "abracadabra"}])


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_roundtrips(tiny_tokenizer: Tokenizer, text: str) -> None:
    token_ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(token_ids, skip_special_tokens=False) == text


def _stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detokenizer.add_token(token_id) for token_id in token_ids] + [detokenizer.flush()]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_incremental_detokenizer_equals_full_decode(model_dir: Path, data,
                                                    skip_special_tokens: bool) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    token_ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = _stream(detokenizer, token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert detokenizer.text == "".join(deltas)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_streamed_valid_text_never_shows_a_replacement_char(tiny_tokenizer: Tokenizer,
                                                            text: str) -> None:
    token_ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=False), token_ids)
    assert "".join(deltas) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in delta for delta in deltas)


def test_character_split_across_byte_tokens_is_held_back(tiny_tokenizer: Tokenizer) -> None:
    text = "ok 𝔘"  # a 4-byte character the tokenizer has no merge for
    token_ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert any(tiny_tokenizer.decode([token_id]) == "\ufffd" for token_id in token_ids)
    deltas = _stream(IncrementalDetokenizer(tiny_tokenizer), token_ids)
    assert "".join(deltas) == text and "𝔘" in deltas


def test_prompt_context_gives_only_generated_text(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt_ids = tokenizer.encode("The river ran", add_special_tokens=False)
    output_ids = tokenizer.encode("The river ran quietly past the mill",
                                  add_special_tokens=False)[len(prompt_ids):]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_ids)
    assert "".join(_stream(detokenizer, output_ids)) == " quietly past the mill"
    assert detokenizer.output_token_ids == output_ids


def test_stop_string_split_across_tokens_is_caught_and_not_emitted(
        tiny_tokenizer: Tokenizer) -> None:
    token_ids = tiny_tokenizer.encode("Hello there. STOPPING here", add_special_tokens=False)
    detokenizer, stop_checker = IncrementalDetokenizer(tiny_tokenizer), StopChecker(["PPI", "xyz"])
    emitted, stopped_at = [], None
    for index, token_id in enumerate(token_ids):
        text, stopped = stop_checker.feed(detokenizer.add_token(token_id))
        emitted.append(text)
        if stopped:
            stopped_at = index
            break
    assert "".join(emitted) == "Hello there. STO"
    assert stop_checker.matched_stop == "PPI" and stopped_at is not None
    assert len(tiny_tokenizer.decode(token_ids[stopped_at:stopped_at + 1])) < len("PPI")


def test_stop_checker_holds_possible_prefixes_and_releases_them() -> None:
    checker = StopChecker(["</answer>"])
    assert checker.feed("result: 4</ans") == ("result: 4", False)
    assert checker.feed("wer") == ("", False)
    assert checker.feed(" and more") == ("</answer and more", False)
    assert checker.feed("</a") == ("", False)
    assert checker.flush() == "</a"


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stop_checker_matches_first_stop_over_any_split(data) -> None:
    text = data.draw(st.text(alphabet="abc d", max_size=30))
    stops = data.draw(st.lists(st.text(alphabet="abc d", min_size=1, max_size=4), max_size=3))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
    checker = StopChecker(stops)
    emitted, stopped = "", False
    for piece in pieces:
        out, stopped = checker.feed(piece)
        emitted += out
        if stopped:
            break
    if not stopped:
        emitted += checker.flush()
    # Generation is causal: the output ends after the first delta that completes a stop
    # string, just before the earliest stop string in the text seen by then.
    expected, expect_stop, seen = text, False, ""
    for piece in pieces:
        seen += piece
        starts = [seen.find(stop) for stop in stops if stop in seen]
        if starts:
            expected, expect_stop = seen[:min(starts)], True
            break
    assert (emitted, stopped) == (expected, expect_stop)
