"""``POST /v1/chat/completions``: messages in, an assistant message per choice out.

    ChatCompletionRequest -> model's chat template -> tokens
        -> generation.prepare/start_generation
        -> ChatCompletionResponse (stream=false) or ``chat.completion.chunk`` SSE (stream=true)

The stream follows OpenAI's order: a first chunk carrying ``role`` (one per choice), content
deltas, a chunk with ``finish_reason`` per choice, then (with
``stream_options.include_usage``) a usage-only chunk. With ``n > 1`` the choices' chunks
interleave, each marked with its ``index``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from slipstream.agent.engine.sampling_params import RequestOutput, TokenLogprob
from slipstream.agent.server.errors import bad_request
from slipstream.agent.server.generation import (
    SSE_HEADERS, Choices, ServingContext, check_model, collect_choices, prepare, sse_event,
    start_choices, stream_events, tokenize, with_kv_transfer)
from slipstream.agent.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, TopLogprob, Usage,
    unix_time_s)
from slipstream.agent.server.structured import response_format_grammar


async def create_chat_completion(ctx: ServingContext, http_request: Request,
                                 body: ChatCompletionRequest
                                 ) -> JSONResponse | StreamingResponse:
    model = check_model(ctx, body.model)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    try:
        prompt_text = ctx.engine.tokenizer.apply_chat_template(messages,
                                                               add_generation_prompt=True)
    except Exception as error:  # template errors (e.g. roles out of order) are the client's
        raise bad_request(f"messages could not be formatted with the model's chat template: "
                          f"{error}", param="messages") from None
    # The template already writes any BOS token; adding special tokens would double it.
    prompt_token_ids = await tokenize(ctx, prompt_text, add_special_tokens=False)
    grammar = await response_format_grammar(ctx, body.response_format)
    prepared = prepare(ctx, f"chatcmpl-{uuid.uuid4().hex}", body, prompt_token_ids,
                       max_tokens=body.requested_max_tokens, logprobs=body.num_logprobs,
                       prompt_param="messages", grammar=grammar,
                       max_tokens_param="max_completion_tokens"
                       if body.max_completion_tokens is not None else "max_tokens")
    choices = await start_choices(ctx, http_request, prepared)
    if body.stream:
        return StreamingResponse(
            _stream(ctx, choices, prepared.request_id, model, body.logprobs,
                    prepared.include_usage_in_stream),
            media_type="text/event-stream", headers=SSE_HEADERS)
    by_choice = await collect_choices(http_request, choices)
    response_choices = []
    for index, outputs in enumerate(by_choice):
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(ctx, [lp for out in outputs for lp in out.logprobs])
        response_choices.append(ChatChoice(
            index=index, message=AssistantMessage(content="".join(o.new_text for o in outputs)),
            logprobs=logprobs, finish_reason=outputs[-1].finish_reason))
    response = ChatCompletionResponse(
        id=prepared.request_id, model=model, choices=response_choices,
        usage=Usage.of(*choices.usage_counts()))
    return JSONResponse(with_kv_transfer(response.model_dump(mode="json"), by_choice[0][-1]))


async def _stream(ctx: ServingContext, choices: Choices, request_id: str, model: str,
                  want_logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    created = unix_time_s()

    def chunk(chunk_choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model,
                                             choices=chunk_choices, usage=usage
                                             ).model_dump_json())

    def render(output: RequestOutput) -> bytes:
        logprobs = chat_logprobs(ctx, output.logprobs) if want_logprobs else None
        delta = ChatDelta(content=output.new_text or None)
        return chunk([ChatChunkChoice(index=choices.index_of[output.request_id], delta=delta,
                                      logprobs=logprobs,
                                      finish_reason=output.finish_reason if output.finished
                                      else None)])

    def usage(_final: RequestOutput) -> bytes:
        return chunk([], Usage.of(*choices.usage_counts()))

    for index in range(len(choices.generations)):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    async for event in stream_events(choices, render, usage if include_usage else None):
        yield event


def chat_logprobs(ctx: ServingContext, token_logprobs: list[TokenLogprob]) -> ChatLogprobs:
    decode = ctx.engine.tokenizer.decode

    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = decode([token_id])
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for chosen in token_logprobs:
        head = entry(chosen.token_id, chosen.logprob)
        content.append(ChatTokenLogprob(
            token=head.token, logprob=head.logprob, bytes=head.bytes,
            top_logprobs=[entry(token_id, logprob) for token_id, logprob in chosen.top]))
    return ChatLogprobs(content=content)
