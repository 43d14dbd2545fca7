"""``POST /v1/chat/completions``: messages in, an assistant message per choice out.

    ChatCompletionRequest -> model's chat template -> tokens
        -> prepare.prepare -> generation.start_choices
        -> ChatCompletionResponse (stream=false) or ``chat.completion.chunk`` SSE (stream=true)

The stream follows OpenAI's order: a first chunk carrying ``role`` (one per choice), content
deltas, a chunk with ``finish_reason`` per choice, then (with
``stream_options.include_usage``) a usage-only chunk. With ``n > 1`` the choices' chunks
interleave, each marked with its ``index``.

With ``tools`` (server/tools.py) the model's call syntax becomes ``tool_calls`` and
``finish_reason`` "tool_calls"; ``tool_choice`` "required" or a named function constrains
the output with a grammar, so the call always parses.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from slipstream.agent.engine.sampling.grammar import lark_grammar
from slipstream.agent.engine.sampling.params import RequestOutput, TokenLogprob
from slipstream.contracts.errors import bad_request
from slipstream.agent.server.generation import Choices, collect_choices, start_choices
from slipstream.agent.server.prepare import ServingContext, check_model, prepare, tokenize
from slipstream.agent.server.sse import (
    SSE_HEADERS, kv_handle_event, sse_event, stream_events, with_kv_transfer)
from slipstream.agent.server.protocol import ChatCompletionRequest
from slipstream.agent.server.responses import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                               ChatCompletionChunk, ChatCompletionResponse,
                                               ChatDelta, ChatLogprobs, ChatTokenLogprob,
                                               FunctionCallDelta, ToolCallDelta, TopLogprob, Usage,
                                               unix_time_s)
from slipstream.agent.server.structured import checked_grammar, response_format_grammar
from slipstream.agent.server.tenancy.identity import caller_of
from slipstream.agent.server.tool_parsers import ToolParser, new_call_id, resolve_parser
from slipstream.agent.server.tool_stream import ToolStream
from slipstream.agent.server.tools import forced_tools, template_messages


async def create_chat_completion(ctx: ServingContext, http_request: Request,
                                 body: ChatCompletionRequest
                                 ) -> JSONResponse | StreamingResponse:
    model = check_model(ctx, body.model)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    tool_choice = body.effective_tool_choice
    template_tools = ([tool.model_dump(exclude_none=True) for tool in body.tools]
                      if body.tools else None)
    try:
        prompt_text = ctx.engine.tokenizer.apply_chat_template(
            template_messages(body.messages), add_generation_prompt=True, tools=template_tools)
    except Exception as error:  # template errors (e.g. roles out of order) are the client's
        raise bad_request(f"messages could not be formatted with the model's chat template: "
                          f"{error}", param="messages") from None
    # The template already writes any BOS token; adding special tokens would double it.
    prompt_token_ids = await tokenize(ctx, prompt_text, add_special_tokens=False,
                                      param="messages")
    parser = None
    if body.tools and tool_choice != "none":
        parser = resolve_parser(ctx.config.tool_call_parser, ctx.engine.tokenizer.chat_template)
    forced = forced_tools(body.tools or [], tool_choice)
    if forced and parser is not None:
        if body.response_format is not None and body.response_format.type != "text":
            raise bad_request("response_format cannot be combined with a forced tool call "
                              "(tool_choice required or a named function)",
                              param="response_format")
        parallel = body.parallel_tool_calls is not False and tool_choice == "required"
        grammar: str | None = await checked_grammar(
            ctx, lark_grammar(parser.grammar(forced, parallel)), "tools",
            "the tools' parameter schemas")
    else:
        grammar = await response_format_grammar(ctx, body.response_format)
    prepared = prepare(ctx, f"chatcmpl-{uuid.uuid4().hex}", body, prompt_token_ids,
                       max_tokens=body.requested_max_tokens, logprobs=body.num_logprobs,
                       prompt_param="messages", grammar=grammar,
                       max_tokens_param="max_completion_tokens"
                       if body.max_completion_tokens is not None else "max_tokens",
                       caller=caller_of(http_request.scope))
    single_call = body.parallel_tool_calls is False
    choices = await start_choices(ctx, http_request, prepared)
    if body.stream:
        return StreamingResponse(
            _stream(ctx, choices, prepared.request_id, model, body.logprobs,
                    prepared.include_usage_in_stream, parser, single_call),
            media_type="text/event-stream", headers=SSE_HEADERS)
    by_choice = await collect_choices(http_request, choices)
    response_choices = []
    for index, outputs in enumerate(by_choice):
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(ctx, [lp for out in outputs for lp in out.logprobs])
        text = "".join(o.new_text for o in outputs)
        finish_reason = outputs[-1].finish_reason
        message = AssistantMessage(content=text)
        if parser is not None:
            content, calls = parser.parse(text)
            if calls:
                calls = calls[:1] if single_call else calls
                message = AssistantMessage(content=content,
                                           tool_calls=[call.to_tool_call() for call in calls])
                finish_reason = "tool_calls"
        response_choices.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                           finish_reason=finish_reason))
    response = ChatCompletionResponse(
        id=prepared.request_id, model=model, choices=response_choices,
        usage=Usage.of(*choices.usage_counts()))
    return JSONResponse(with_kv_transfer(response.model_dump(mode="json"), by_choice[0][-1]))


async def _stream(ctx: ServingContext, choices: Choices, request_id: str, model: str,
                  want_logprobs: bool, include_usage: bool, parser: ToolParser | None = None,
                  single_call: bool = False) -> AsyncIterator[bytes]:
    created = unix_time_s()
    tool_streams = [ToolStream(parser, max_calls=1 if single_call else None)
                    for _ in choices.generations] if parser else []

    def chunk(chunk_choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model,
                                             choices=chunk_choices, usage=usage
                                             ).model_dump_json())

    def render(output: RequestOutput) -> bytes:
        index = choices.index_of[output.request_id]
        logprobs = chat_logprobs(ctx, output.logprobs) if want_logprobs else None
        finish_reason = output.finish_reason if output.finished else None
        if not tool_streams:
            delta = ChatDelta(content=output.new_text or None)
            return chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                          finish_reason=finish_reason)])
        stream = tool_streams[index]
        content, call_deltas = stream.feed(output.new_text, output.finished)
        events = []
        if content or logprobs is not None:
            events.append(chunk([ChatChunkChoice(index=index,
                                                 delta=ChatDelta(content=content or None),
                                                 logprobs=logprobs)]))
        for call in call_deltas:
            if call.name is not None:  # a call begins: OpenAI's first delta of a call
                tool_delta = ToolCallDelta(index=call.index, id=new_call_id(), type="function",
                                           function=FunctionCallDelta(name=call.name,
                                                                      arguments=""))
            else:
                tool_delta = ToolCallDelta(index=call.index,
                                           function=FunctionCallDelta(arguments=call.arguments))
            events.append(chunk([ChatChunkChoice(index=index,
                                                 delta=ChatDelta(tool_calls=[tool_delta]))]))
        if output.finished:
            if stream.num_calls and finish_reason != "length":  # cut calls show as cut
                finish_reason = "tool_calls"
            events.append(chunk([ChatChunkChoice(index=index, delta=ChatDelta(),
                                                 finish_reason=finish_reason)]))
        return b"".join(events)

    def usage(_final: RequestOutput) -> bytes:
        return chunk([], Usage.of(*choices.usage_counts()))

    if handle_event := kv_handle_event(choices, request_id):
        yield handle_event  # a prefill leg's streaming KV handle, for the router
    for index in range(len(choices.generations)):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    async for event in stream_events(choices, render, usage if include_usage else None):
        if event:
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
