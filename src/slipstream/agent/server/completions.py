"""``POST /v1/completions``: one text or token-id prompt in, generated text out.

    CompletionRequest -> prepare.tokenize/prepare -> generation.start_choices
        -> CompletionResponse (stream=false) or ``text_completion`` SSE chunks (stream=true)

``echo`` puts the prompt's text before each choice's text (streamed: in that choice's first
chunk). Logprobs of prompt tokens are not computed, so ``echo`` with ``logprobs`` is a 400.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from slipstream.agent.engine.sampling.params import RequestOutput, TokenLogprob
from slipstream.contracts.errors import bad_request
from slipstream.agent.server.generation import Choices, collect_choices, start_choices
from slipstream.agent.server.prepare import ServingContext, check_model, prepare, tokenize
from slipstream.agent.server.sse import (
    SSE_HEADERS, kv_handle_event, sse_event, stream_events, with_kv_transfer)
from slipstream.agent.server.tenancy.identity import caller_of
from slipstream.agent.server.protocol import CompletionRequest
from slipstream.agent.server.responses import (CompletionChoice, CompletionLogprobs,
                                               CompletionResponse, Usage, unix_time_s)


async def create_completion(ctx: ServingContext, http_request: Request,
                            body: CompletionRequest) -> JSONResponse | StreamingResponse:
    model = check_model(ctx, body.model)
    if isinstance(body.prompt, str):
        prompt_token_ids = await tokenize(ctx, body.prompt, add_special_tokens=True)
    else:
        prompt_token_ids = list(body.prompt)
        vocab_size = getattr(ctx.engine.tokenizer, "vocab_size", None)
        if vocab_size is not None and max(prompt_token_ids) >= vocab_size:
            raise bad_request(f"prompt token ids must be below the vocabulary size "
                              f"{vocab_size}", param="prompt")
    if not prompt_token_ids:
        raise bad_request("prompt must not be empty", param="prompt")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not "
                          "computed); drop one of them", param="echo")
    prepared = prepare(ctx, f"cmpl-{uuid.uuid4().hex}", body, prompt_token_ids,
                       max_tokens=body.max_tokens, logprobs=body.logprobs, prompt_param="prompt",
                       caller=caller_of(http_request.scope))
    echo = _prompt_text(ctx, body.prompt) if body.echo else ""
    choices = await start_choices(ctx, http_request, prepared)
    if body.stream:
        return StreamingResponse(
            _stream(ctx, choices, prepared.request_id, model, body.logprobs is not None,
                    prepared.include_usage_in_stream, echo),
            media_type="text/event-stream", headers=SSE_HEADERS)
    by_choice = await collect_choices(http_request, choices)
    return JSONResponse(with_kv_transfer(
        _response(ctx, prepared.request_id, model, choices, by_choice,
                  body.logprobs is not None, echo).model_dump(mode="json"), by_choice[0][-1]))


def _prompt_text(ctx: ServingContext, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else ctx.engine.tokenizer.decode(prompt)


def _response(ctx: ServingContext, request_id: str, model: str, choices: Choices,
              by_choice: list[list[RequestOutput]], want_logprobs: bool,
              echo: str) -> CompletionResponse:
    response_choices = []
    for index, outputs in enumerate(by_choice):
        logprobs = None
        if want_logprobs:
            logprobs, _ = completion_logprobs(
                ctx, [lp for out in outputs for lp in out.logprobs], 0)
        response_choices.append(CompletionChoice(
            index=index, text=echo + "".join(out.new_text for out in outputs),
            logprobs=logprobs, finish_reason=outputs[-1].finish_reason))
    return CompletionResponse(id=request_id, model=model, choices=response_choices,
                              usage=Usage.of(*choices.usage_counts()))


def _stream(ctx: ServingContext, choices: Choices, request_id: str, model: str,
            want_logprobs: bool, include_usage: bool, echo: str) -> AsyncIterator[bytes]:
    created = unix_time_s()
    text_offsets = [0] * len(choices.generations)
    echoed = [not echo] * len(choices.generations)

    def render(output: RequestOutput) -> bytes:
        index = choices.index_of[output.request_id]
        logprobs = None
        if want_logprobs:
            logprobs, text_offsets[index] = completion_logprobs(ctx, output.logprobs,
                                                                text_offsets[index])
        text = output.new_text
        if not echoed[index]:
            text, echoed[index] = echo + text, True
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=output.finish_reason if output.finished else None)
        return sse_event(CompletionResponse(id=request_id, created=created, model=model,
                                            choices=[choice]).model_dump_json())

    def usage(_final: RequestOutput) -> bytes:
        return sse_event(CompletionResponse(
            id=request_id, created=created, model=model, choices=[],
            usage=Usage.of(*choices.usage_counts())).model_dump_json())

    return stream_events(choices, render, usage if include_usage else None,
                         prelude=kv_handle_event(choices, request_id))


def completion_logprobs(ctx: ServingContext, token_logprobs: list[TokenLogprob],
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """The legacy parallel-list shape; returns it and the text offset after its tokens.

    Tokens are named by their own text (``Tokenizer.token_text``: special tokens included,
    partial UTF-8 as ``bytes:\\x..``), so no two entries of ``top_logprobs`` share a key.
    ``text_offset`` counts characters of the returned text, which leaves special tokens out;
    a character split across tokens counts at the token that completes it."""
    tokenizer = ctx.engine.tokenizer
    result = CompletionLogprobs()
    text_bytes = b""
    for entry in token_logprobs:
        result.tokens.append(tokenizer.token_text(entry.token_id))
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({tokenizer.token_text(token_id): logprob
                                    for token_id, logprob in entry.top})
        result.text_offset.append(text_offset + len(text_bytes.decode("utf-8", "ignore")))
        if entry.token_id not in tokenizer.special_token_ids:
            text_bytes += tokenizer.token_bytes(entry.token_id)
    return result, text_offset + len(text_bytes.decode("utf-8", "ignore"))
