"""What a request must fit to be served, as pure data: the engine checks it, and so does the
API process of a two-process server (``agent/server/engine_core.py``) before a request
crosses to the engine core, so bad input gets its 400 at once."""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.block_manager import blocks_for_tokens


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    kv_blocks_total: int

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a user-facing message if the request can never be served."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}); got {bad_stops[:5]}")
        bad_bias = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {bad_bias[:5]}")
        prompt_len = len(prompt_token_ids)
        if prompt_len + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{prompt_len + params.max_tokens} were requested ({prompt_len} in the prompt, "
                f"{params.max_tokens} for the completion); shorten the prompt or max_tokens")
        needed = blocks_for_tokens(prompt_len + params.max_tokens)
        if needed > self.kv_blocks_total:
            raise ValueError(f"the request needs {needed} KV blocks but the cache has only "
                             f"{self.kv_blocks_total}")
