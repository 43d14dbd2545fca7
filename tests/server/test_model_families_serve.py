"""Each new dense family (Qwen3, Gemma 2, Gemma 3: tests/engine/family_models.py) served by a
real ``slipstream serve`` and asked through the official ``openai`` client: the greedy text
is transformers' ``generate`` on the same directory, decoded by transformers' tokenizer. The
prompt (token ids) is longer than Gemma's 12-token sliding window."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tests.engine.family_models import FAMILIES, load_reference
from tests.server.conftest import SERVED_MODEL_NAME

PROMPT = [(29 * j + 17) % 4000 for j in range(20)]
NEW_TOKENS = 10


@pytest.mark.parametrize("family", FAMILIES)
def test_served_greedy_text_equals_transformers(family, family_model_dirs, serve_model,
                                                tmp_path):
    model_dir = family_model_dirs[family]
    with torch.no_grad():
        out = load_reference(model_dir).generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, pad_token_id=0)
    expected = AutoTokenizer.from_pretrained(model_dir).decode(
        out[0, len(PROMPT):].tolist(), skip_special_tokens=True)
    with serve_model(model_dir, tmp_path) as server:
        client = server.openai_client()
        result = client.completions.create(model=SERVED_MODEL_NAME, prompt=PROMPT,
                                           max_tokens=NEW_TOKENS, temperature=0.0,
                                           extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=SERVED_MODEL_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True}) if chunk.choices)
    assert result.usage.completion_tokens == NEW_TOKENS
    assert expected and result.choices[0].text == expected
    assert streamed == expected
