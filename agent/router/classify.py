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


class LengthClassifier:
    def __init__(self, tokenizer: Tokenizer | None, long_prefill_threshold_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.long_prefill_threshold_tokens = long_prefill_threshold_tokens

    def classify(self, endpoint: str, body: Any, now_s: float | None = None) -> RoutedRequest:
        now_s = time.monotonic() if now_s is None else now_s
        if not isinstance(body, dict):
            body = {}
        prompt_tokens = self.count_prompt_tokens(endpoint, body)
        long = prompt_tokens >= self.long_prefill_threshold_tokens
        app_id = body.get("app_id")
        return RoutedRequest(
            request_class=LONG_POOL if long else SHORT_POOL,
            prompt_tokens=prompt_tokens,
            app_id=app_id if isinstance(app_id, str) and app_id else DEFAULT_APP_ID,
            stream=body.get("stream") is True,
            max_tokens=_max_tokens(body),
            ttft_deadline_s=_ttft_deadline(body, now_s),
            arrival_s=now_s)

    def count_prompt_tokens(self, endpoint: str, body: dict) -> int:
        try:
            if endpoint == CHAT:
                return self._count_chat(body.get("messages"))
            return self._count_completion(body.get("prompt"))
        except Exception as error:  # a template rejecting the conversation: the agent says why
            log.debug("could not count prompt tokens: %s", error)
            return 0

    def _count_completion(self, prompt: Any) -> int:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one, as the agent accepts
        if isinstance(prompt, list):
            return len(prompt)  # token ids
        if not isinstance(prompt, str):
            return 0
        if self.tokenizer is None:
            return _estimate_tokens(prompt)
        return len(self.tokenizer.encode(prompt))

    def _count_chat(self, messages: Any) -> int:
        if not isinstance(messages, list):
            return 0
        texts = [(message.get("role"), _message_text(message.get("content")))
                 for message in messages if isinstance(message, dict)]
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            return sum(_estimate_tokens(text) for _, text in texts)
        plain = [{"role": role, "content": text} for role, text in texts]
        return len(self.tokenizer.encode_chat(plain, add_generation_prompt=True))


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
