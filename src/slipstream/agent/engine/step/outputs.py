"""What ``LLMEngine`` hands back for each request: its output bookkeeping and the outputs.

The scheduler owns a request's tokens; ``OutputState`` owns what only the outputs need (the
sampling params, the text made so far, logprobs not yet sent, the grammar matcher, first-token
time). ``OutputState.advance`` turns one sampled token into new text and, where the request
ends there, its finish reason; ``step_output``, ``final_output`` and ``error_output`` build the
``RequestOutput`` the serving layer streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slipstream.agent.engine.sampling.params import RequestOutput, TokenLogprob
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.detokenizer import TextStream
from slipstream.agent.scheduler.request import FinishReason, Request


@dataclass
class OutputState:
    """Per-request output bookkeeping that the scheduler does not need."""

    params: SamplingParams
    text: TextStream
    arrival_s: float
    first_token_s: float | None = None
    emitted_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    matcher: Any = None  # llguidance.LLMatcher of a request with a grammar

    def add_token(self, token_id: int) -> tuple[str, bool]:
        return self.text.add_token(token_id)

    def flush(self) -> str:
        return self.text.flush()

    def advance(self, token: int, *, stop_token: bool, at_length: bool,
                with_text: bool) -> tuple[str, FinishReason | None]:
        """The new text of a sampled ``token`` (which the grammar matcher, if any, has taken)
        and why the request ends with it, if it does: a stop token or EOS, a stop string, a
        complete grammar, or the length limit (``at_length``). Without ``with_text`` (an
        engine-core process, whose API process makes the text) the text stays empty and stop
        strings are left to the API process."""
        if not with_text:
            if stop_token:
                return "", FinishReason.STOP
            if self.matcher is not None and self.matcher.is_stopped():
                return "", FinishReason.STOP  # the grammar is done
            return "", FinishReason.LENGTH if at_length else None
        if stop_token:
            return self.flush(), FinishReason.STOP
        text, hit_stop_string = self.add_token(token)
        if hit_stop_string:
            return text, FinishReason.STOP
        if self.matcher is not None and self.matcher.is_stopped():
            return text + self.flush(), FinishReason.STOP  # the grammar is done
        if at_length:
            return text + self.flush(), FinishReason.LENGTH
        return text, None


def step_output(request: Request, new_tokens: list[int], text: str,
                logprobs: list[TokenLogprob]) -> RequestOutput:
    """An output of a request that goes on."""
    return RequestOutput(request_id=request.request_id, new_token_ids=new_tokens, new_text=text,
                         num_prompt_tokens=request.prompt_len,
                         num_output_tokens=request.num_output_tokens, logprobs=logprobs,
                         num_cached_tokens=request.num_cached_tokens)


def final_output(request: Request, state: OutputState, new_tokens: list[int], text: str,
                 error: str | None = None) -> RequestOutput:
    """The last output of a request the scheduler has finished, with its timings."""
    reason = request.finish_reason.value if request.finish_reason else None
    return RequestOutput(
        request_id=request.request_id, new_token_ids=new_tokens, new_text=text,
        num_prompt_tokens=request.prompt_len, num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens, finished=True, finish_reason=reason,
        logprobs=state.logprobs, arrival_s=state.arrival_s, first_token_s=state.first_token_s,
        finished_s=request.finished_s, error=error)


def error_output(request_id: str, message: str, code: str) -> RequestOutput:
    """The final output of a request that ends with an error and nothing else to show."""
    return RequestOutput(request_id, [], "", 0, 0, finished=True,
                         finish_reason=FinishReason.ERROR.value, error=message, error_code=code)
