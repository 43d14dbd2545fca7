"""What the engine streams back for a request (``RequestOutput``). ``SamplingParams``, what
the request asks for, lives with the request type in ``slipstream.contracts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first


@dataclass
class RequestOutput:
    """One increment of a request's output, as the engine streams it to the API layer."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Wall-clock times (time.monotonic()) for metrics: set on the final output.
    arrival_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None  # for the client: never an exception's text
    error_code: str | None = None  # one of the codes in engine/errors.py
    # Prompt tokens whose KV came from the prefix cache (the API's cached_tokens).
    num_cached_tokens: int = 0
    # Prefill role: where a decode instance fetches this request's KV (KVHandle.to_json()).
    kv_transfer: dict | None = None
    # The last new token is a stop token or EOS, which shows no text (for the API process of
    # a two-process server, which makes the text itself: agent/server/engine_core.py).
    stop_token: bool = False
