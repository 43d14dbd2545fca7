"""``POST /v1/chat/completions``: messages in, one assistant message out.

    ChatCompletionRequest -> model's chat template -> tokens
        -> generation.prepare/start_generation
        -> ChatCompletionResponse (stream=false) or ``chat.completion.chunk`` SSE (stream=true)

The stream follows OpenAI's order: a first chunk carrying ``role``, content deltas, a chunk
with ``finish_reason``, then (with ``stream_options.include_usage``) a usage-only chunk.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from slipstream.agent.engine.sampling_params import RequestOutput, TokenLogprob
from slipstream.agent.server.errors import bad_request
from slipstream.agent.server.generation import (
    with_kv_transfer,
    SSE_HEADERS, Generation, ServingContext, check_model, collect_outputs, prepare, sse_event,
    start_generation, stream_events, tokenize)
from slipstream.agent.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, TopLogprob, Usage,
    unix_time_s)


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
    prepared = prepare(ctx, f"chatcmpl-{uuid.uuid4().hex}", body, prompt_token_ids,
                       max_tokens=body.requested_max_tokens, logprobs=body.num_logprobs,
                       prompt_param="messages",
                       max_tokens_param="max_completion_tokens"
                       if body.max_completion_tokens is not None else "max_tokens")
    generation = await start_generation(ctx, http_request, prepared)
    if body.stream:
        return StreamingResponse(
            _stream(ctx, generation, prepared.request_id, model, body.logprobs,
                    prepared.include_usage_in_stream),
            media_type="text/event-stream", headers=SSE_HEADERS)
    outputs = await collect_outputs(http_request, generation)
    final = outputs[-1]
    logprobs = None
    if body.logprobs:
        logprobs = chat_logprobs(ctx, [lp for out in outputs for lp in out.logprobs])
    choice = ChatChoice(message=AssistantMessage(content="".join(o.new_text for o in outputs)),
                        logprobs=logprobs, finish_reason=final.finish_reason)
    response = ChatCompletionResponse(
        id=prepared.request_id, model=model, choices=[choice],
        usage=Usage.of(final.num_prompt_tokens, final.num_output_tokens))
    return JSONResponse(with_kv_transfer(response.model_dump(mode="json"), final))


async def _stream(ctx: ServingContext, generation: Generation, request_id: str, model: str,
                  want_logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    created = unix_time_s()

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model,
                                             choices=choices, usage=usage).model_dump_json())

    def render(output: RequestOutput) -> bytes:
        logprobs = chat_logprobs(ctx, output.logprobs) if want_logprobs else None
        delta = ChatDelta(content=output.new_text or None)
        return chunk([ChatChunkChoice(delta=delta, logprobs=logprobs,
                                      finish_reason=output.finish_reason if output.finished
                                      else None)])

    def usage(final: RequestOutput) -> bytes:
        return chunk([], Usage.of(final.num_prompt_tokens, final.num_output_tokens))

    yield chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
    async for event in stream_events(generation, render, usage if include_usage else None):
        yield event


def chat_logprobs(ctx: ServingContext, token_logprobs: list[TokenLogprob]) -> ChatLogprobs:
    tokenizer = ctx.engine.tokenizer

    def entry(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=tokenizer.token_text(token_id), logprob=logprob,
                          bytes=list(tokenizer.token_bytes(token_id)))

    content = []
    for chosen in token_logprobs:
        head = entry(chosen.token_id, chosen.logprob)
        content.append(ChatTokenLogprob(
            token=head.token, logprob=head.logprob, bytes=head.bytes,
            top_logprobs=[entry(token_id, logprob) for token_id, logprob in chosen.top]))
    return ChatLogprobs(content=content)
