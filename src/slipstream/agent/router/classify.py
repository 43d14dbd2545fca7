"""Request classification: how long is the prompt, and so which prefill pool serves it.

    POST body (JSON, untouched) --classify()--> RoutedRequest(class, prompt_tokens, app_id, ...)
        --> dispatcher (pool, fair queue) --> proxy (forwards the original bytes)

Prompt length is counted with the model's own tokenizer, the way the agent will count it:
completions encode the prompt with the model's special tokens, chat renders the messages with
the chat template (which writes BOS itself) and encodes without them. Only what routing needs
is read from the body; validating it stays the agent's job, so a body the router cannot read
is sent to the short pool and the agent answers with the precise 400.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.router.config import LONG_POOL, SHORT_POOL
from slipstream.agent.router.prefix_affinity import prefix_keys

log = logging.getLogger(__name__)
DEFAULT_APP_ID = "default"
COMPLETIONS = "completions"
CHAT = "chat"


@dataclass(frozen=True)
class RoutedRequest:
    request_class: str  # short or long: which pool should prefill it
    prompt_tokens: int
    app_id: str
    stream: bool
    max_tokens: int | None
    ttft_deadline_s: float | None  # absolute, on time.monotonic(); from the request's slo
    arrival_s: float
    # Chained keys of the prompt's blocks (prefix_affinity.py), for prefix-aware routing.
    prefix_keys: tuple[bytes, ...] = ()
    share_weight: float = 1.0  # the tenant's fair share (tenants on); 1 otherwise


class LengthClassifier:
    def __init__(self, tokenizer: Tokenizer | None, long_prefill_threshold_tokens: int,
                 prefix_block_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.long_prefill_threshold_tokens = long_prefill_threshold_tokens
        # None: no prefix keys (prefix-aware routing off).
        self.prefix_block_tokens = prefix_block_tokens

    def classify(self, endpoint: str, body: Any, now_s: float | None = None) -> RoutedRequest:
        now_s = time.monotonic() if now_s is None else now_s
        if not isinstance(body, dict):
            body = {}
        prompt = self.prompt_ids(endpoint, body)
        prompt_tokens = prompt if isinstance(prompt, int) else len(prompt)
        long = prompt_tokens >= self.long_prefill_threshold_tokens
        keys: tuple[bytes, ...] = ()
        if self.prefix_block_tokens is not None and not isinstance(prompt, int):
            keys = tuple(prefix_keys(prompt, self.prefix_block_tokens))
        app_id = body.get("app_id")
        return RoutedRequest(
            request_class=LONG_POOL if long else SHORT_POOL,
            prompt_tokens=prompt_tokens,
            app_id=app_id if isinstance(app_id, str) and app_id else DEFAULT_APP_ID,
            stream=body.get("stream") is True,
            max_tokens=_max_tokens(body),
            ttft_deadline_s=_ttft_deadline(body, now_s),
            arrival_s=now_s, prefix_keys=keys)

    def count_prompt_tokens(self, endpoint: str, body: dict) -> int:
        prompt = self.prompt_ids(endpoint, body)
        return prompt if isinstance(prompt, int) else len(prompt)

    def prompt_ids(self, endpoint: str, body: dict) -> list[int] | int:
        """The prompt's token ids, or only their estimated count when there is no tokenizer
        to read text with (the request then has no prefix keys: it is routed by load)."""
        try:
            if endpoint == CHAT:
                return self._chat_ids(body.get("messages"))
            return self._completion_ids(body.get("prompt"))
        except Exception as error:  # a template rejecting the conversation: the agent says why
            log.debug("could not count prompt tokens: %s", error)
            return 0

    def _completion_ids(self, prompt: Any) -> list[int] | int:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one, as the agent accepts
        if isinstance(prompt, list):
            return [t for t in prompt if isinstance(t, int)]  # token ids
        if not isinstance(prompt, str):
            return 0
        if self.tokenizer is None:
            return _estimate_tokens(prompt)
        return self.tokenizer.encode(prompt)

    def _chat_ids(self, messages: Any) -> list[int] | int:
        if not isinstance(messages, list):
            return 0
        texts = [(message.get("role"), _message_text(message.get("content")))
                 for message in messages if isinstance(message, dict)]
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            return sum(_estimate_tokens(text) for _, text in texts)
        plain = [{"role": role, "content": text} for role, text in texts]
        return self.tokenizer.encode_chat(plain, add_generation_prompt=True)


def _message_text(content: Any) -> str:
    """The text the agent feeds the template: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _estimate_tokens(text: str) -> int:
    # Without a tokenizer: about four characters per token for English BPE vocabularies.
    return (len(text) + 3) // 4


def _max_tokens(body: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _ttft_deadline(body: dict, now_s: float) -> float | None:
    slo = body.get("slo")
    ttft_s = slo.get("ttft_s") if isinstance(slo, dict) else None
    if isinstance(ttft_s, (int, float)) and not isinstance(ttft_s, bool) and ttft_s > 0:
        return now_s + float(ttft_s)
    return None
