"""The part of a request's trip shared by completions and chat: checks, engine call, teardown.

    validated request -> prepare(): model name, context limits, SamplingParams, SLO
        -> start_generation(): engine.generate(), wait for the first output
        -> Generation: iterate outputs, feed metrics, abort in the engine if the client leaves

``n > 1`` runs one engine request per choice (``PreparedRequest.choices``), each with its own
seed stream, started together by ``start_choices`` and merged by ``Choices``. Each choice
computes the prompt itself: sharing its KV across choices waits for prefix caching.

Why wait for the first output before answering: the engine reports bad requests (for example
a prompt that does not fit the KV cache) by raising before its first output. Waiting lets a
streaming request still get a proper 400 instead of an error inside a 200 event stream.

A client that disconnects must free its KV blocks at once. While the handler waits (non-stream
requests, and streams before the first token) a watcher on the ASGI receive channel cancels
the wait; once streaming, Starlette cancels the response task itself. Either way the
cancellation lands inside the engine's generator, which aborts the request, and teardown also
calls ``engine.abort`` under a shield in case it did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from starlette.requests import Request

from slipstream.agent.engine import errors
from slipstream.agent.engine.errors import EngineUnavailable
from slipstream.agent.engine.sampling_params import RequestOutput, SamplingParams
from slipstream.agent.scheduler.request import RequestSLO
from slipstream.agent.server.config import ServerConfig
from slipstream.agent.server.errors import APIError, bad_request, model_not_found
from slipstream.agent.server.metrics import RequestTimer, ServingMetrics
from slipstream.agent.server.protocol import SloSpec, _GenerationRequest

if TYPE_CHECKING:
    from slipstream.agent.server.engine_core import ServingEngine

T = TypeVar("T")
# Tokenizing more than this many characters moves to a thread, off the event loop.
_TOKENIZE_IN_THREAD_CHARS = 16_384
# After tokenizing a text this long, return freed memory to the OS (release_free_memory).
_TRIM_AFTER_CHARS = 1 << 20
_malloc_trim: Any = None


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


@dataclass(frozen=True)
class ServingContext:
    engine: ServingEngine
    metrics: ServingMetrics
    config: ServerConfig


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    app_id: str
    priority: int
    slo: RequestSLO | None
    include_usage_in_stream: bool
    kv_transfer: dict | None = None  # disaggregation (engine/disagg.py)
    num_choices: int = 1
    share_prompt_with: str | None = None  # choices 1.. of n > 1: choice 0's request id

    def choices(self) -> list[PreparedRequest]:
        """One engine request per choice. Choice 0 is this request itself (so ``n=1`` is
        unchanged); choice ``i`` gets its own id and, when seeded, its own seed stream, and
        reuses choice 0's prompt KV (the engine computes the prompt once)."""
        if self.num_choices == 1:
            return [self]
        result = []
        for index in range(self.num_choices):
            params = self.params
            if params.seed is not None and index:
                params = dataclasses.replace(params, seed=choice_seed(params.seed, index))
            result.append(dataclasses.replace(
                self, request_id=f"{self.request_id}-{index}", params=params, num_choices=1,
                share_prompt_with=f"{self.request_id}-0" if index else None))
        return result


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``: a signed 64-bit value
    that differs per choice, so choices draw independent streams, reproducibly."""
    mixed = (seed + index * 0x9E3779B97F4A7C15) % 2**64
    return mixed - 2**64 if mixed >= 2**63 else mixed


def check_model(ctx: ServingContext, requested: str | None) -> str:
    served = ctx.engine.model_name
    if requested is not None and requested != served:
        raise model_not_found(requested)
    return served


async def tokenize(ctx: ServingContext, text: str, *, add_special_tokens: bool,
                   param: str = "prompt") -> list[int]:
    """The prompt's token ids. Tokenizing stops once the prompt is known not to fit the
    context (so a huge prompt costs what the cap allows, not what its size would), and a long
    one is tokenized on a worker thread with the GIL released, so the event loop keeps
    serving everyone else meanwhile."""
    tokenizer = ctx.engine.tokenizer
    max_model_len = ctx.engine.max_model_len
    cap = max_model_len - 1  # at least one token of output
    if len(text) <= _TOKENIZE_IN_THREAD_CHARS:
        ids: list[int] | None = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if ids is not None and len(ids) > cap:
            ids = None
    else:
        ids = await asyncio.to_thread(tokenizer.encode_capped, text, cap,
                                      add_special_tokens=add_special_tokens)
        if len(text) >= _TRIM_AFTER_CHARS:
            release_free_memory()
    if ids is None:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has more than {cap} tokens, which leaves no room for output. Please "
            "shorten the prompt.", param=param, code="context_length_exceeded")
    return ids


def release_free_memory() -> None:
    """Give the memory freed after a huge request back to the OS. glibc keeps freed blocks
    in per-thread arenas; after a multi-megabyte body tokenized on a worker thread they would
    otherwise stay in the process's RSS for good."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def prepare(ctx: ServingContext, request_id: str, body: _GenerationRequest,
            prompt_token_ids: list[int], *, max_tokens: int | None, logprobs: int | None,
            prompt_param: str, max_tokens_param: str = "max_tokens",
            grammar: str | None = None) -> PreparedRequest:
    """Check the request against the model's limits and build what the engine takes;
    ``grammar`` (llguidance, already checked) constrains every output."""
    resolved_max_tokens = resolve_max_tokens(ctx, len(prompt_token_ids), max_tokens,
                                             prompt_param, max_tokens_param)
    kv_transfer = body.kv_transfer_params
    if kv_transfer and body.num_choices > 1:
        raise bad_request("kv_transfer_params needs n=1", param="n")
    params = build_sampling_params(body, resolved_max_tokens, logprobs, grammar)
    return PreparedRequest(
        request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
        app_id=body.app_id or (body.user or "")[:256] or "default", priority=body.priority,
        slo=build_slo(body.slo, ctx.config),
        include_usage_in_stream=body.include_usage_in_stream, num_choices=body.num_choices,
        kv_transfer=kv_transfer)


def resolve_max_tokens(ctx: ServingContext, num_prompt_tokens: int, requested: int | None,
                       prompt_param: str, max_tokens_param: str = "max_tokens") -> int:
    max_model_len = ctx.engine.max_model_len
    room = max_model_len - num_prompt_tokens
    if requested is not None and requested < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {requested}",
                          param=max_tokens_param)
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for output. Please "
            "shorten the prompt.", param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return min(room, ctx.config.default_max_tokens_cap)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion). Please reduce the prompt or "
            f"{max_tokens_param}.", param=max_tokens_param, code="context_length_exceeded")
    return requested


def build_sampling_params(body: _GenerationRequest, max_tokens: int,
                          logprobs: int | None, grammar: str | None = None) -> SamplingParams:
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_k": -1 if body.top_k is None else body.top_k,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "seed": body.seed,
        "stop": body.stop_strings,
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": body.logit_bias_pairs,
        "grammar": grammar,
    }
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        # Messages start with the field name ("top_p must be in (0, 1], got 2.0").
        message = str(error)
        first_word = message.split(" ", 1)[0]
        raise bad_request(message, param=first_word if first_word in fields else None) from None


def build_slo(spec: SloSpec | None, config: ServerConfig | None = None) -> RequestSLO | None:
    """The request's SLO; fields it leaves out take the instance's (``--slo-*``), so the
    engine schedules by them and its load window measures TTFT against them (the control
    API's SLO deviation, which drives pool rebalancing)."""
    ttft_s = spec.ttft_s if spec is not None else None
    tpot_ms = spec.tpot_ms if spec is not None else None
    if config is not None:
        ttft_s = ttft_s if ttft_s is not None else config.slo_ttft_s
        tpot_ms = tpot_ms if tpot_ms is not None else config.slo_tpot_ms
    tpot_s = None if tpot_ms is None else tpot_ms / 1000.0
    if ttft_s is None and tpot_s is None:
        return None
    return RequestSLO(ttft_s=ttft_s, tpot_s=tpot_s)


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it and raise ``ClientDisconnected`` if the client leaves first."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected
    return work_task.result()


class Generation:
    """One request's outputs, from the first (already received) to the last."""

    def __init__(self, ctx: ServingContext, prepared: PreparedRequest,
                 outputs: AsyncIterator[RequestOutput], first: RequestOutput,
                 timer: RequestTimer) -> None:
        self._ctx = ctx
        self._prepared = prepared
        self._outputs = outputs
        self._first = first
        self._timer = timer

    @property
    def first(self) -> RequestOutput:
        """The output ``start_generation`` waited for."""
        return self._first

    async def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        output: RequestOutput | None = self._first
        finished = False
        try:
            while output is not None:
                self._timer.on_output(output)
                if output.finished:
                    # Mark before yielding: a consumer may stop at the final output.
                    finished = True
                    self._timer.finish(output, output.finish_reason or "stop")
                yield output
                if finished:
                    return
                output = await anext(self._outputs, None)
        finally:
            if not finished:
                self._timer.finish(None, "abort")
                with anyio.CancelScope(shield=True):
                    await release(self._ctx, self._prepared.request_id, self._outputs)

    async def collect(self) -> list[RequestOutput]:
        async with contextlib.aclosing(self.__aiter__()) as outputs:
            return [output async for output in outputs]

    async def aclose(self) -> None:
        """Give up on a generation that will not be iterated (another choice failed)."""
        self._timer.finish(None, "abort")
        with anyio.CancelScope(shield=True):
            await release(self._ctx, self._prepared.request_id, self._outputs)


class Choices:
    """The generations of one request's ``n`` choices; choice ``i`` is ``generations[i]``.
    Iterating yields every choice's outputs as they come (``index_of`` tells whose)."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations
        self.index_of = {g._prepared.request_id: i for i, g in enumerate(generations)}
        self.finals: dict[int, RequestOutput] = {}

    async def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        if len(self.generations) == 1:
            async with contextlib.aclosing(self.generations[0].__aiter__()) as outputs:
                async for output in outputs:
                    self._note(output)
                    yield output
            return
        queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

        async def pump(generation: Generation) -> None:
            try:
                async with contextlib.aclosing(generation.__aiter__()) as outputs:
                    async for output in outputs:
                        queue.put_nowait(output)
            except Exception as error:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(error)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(g)) for g in self.generations]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self._note(item)
                yield item
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    def _note(self, output: RequestOutput) -> None:
        if output.finished:
            self.finals[self.index_of[output.request_id]] = output

    async def collect(self) -> list[list[RequestOutput]]:
        """Every choice's outputs, in choice order."""
        by_choice: list[list[RequestOutput]] = [[] for _ in self.generations]
        async with contextlib.aclosing(self.__aiter__()) as outputs:
            async for output in outputs:
                by_choice[self.index_of[output.request_id]].append(output)
        return by_choice

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached prompt tokens): the prompt once, as OpenAI
        counts it for n > 1, and of it what every choice found in the prefix cache."""
        finals = list(self.finals.values())
        if not finals:
            return 0, 0, 0
        return (finals[0].num_prompt_tokens, sum(f.num_output_tokens for f in finals),
                min(f.num_cached_tokens for f in finals))


async def release(ctx: ServingContext, request_id: str,
                  outputs: AsyncIterator[RequestOutput]) -> None:
    """Make sure an unfinished request holds no engine resources."""
    with contextlib.suppress(Exception):
        await outputs.aclose()  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        await ctx.engine.abort(request_id)


async def start_generation(ctx: ServingContext, http_request: Request,
                           prepared: PreparedRequest) -> Generation:
    """Submit to the engine and wait for its first output (or its refusal)."""
    try:
        outputs = ctx.engine.generate(prepared.request_id, prepared.prompt_token_ids,
                                      prepared.params, app_id=prepared.app_id,
                                      priority=prepared.priority, slo=prepared.slo,
                                      kv_transfer=prepared.kv_transfer,
                                      share_prompt_with=prepared.share_prompt_with)
    except ValueError as error:
        raise bad_request(str(error)) from None
    except EngineUnavailable as error:
        raise APIError(503, str(error), code="engine_unavailable") from None
    timer = ctx.metrics.start_request(len(prepared.prompt_token_ids), prepared.slo)
    try:
        first = await run_until_disconnect(http_request, anext(outputs))
    except ValueError as error:
        timer.finish(None, "error")
        raise bad_request(str(error)) from None
    except StopAsyncIteration:
        timer.finish(None, "error")
        raise APIError(500, "the engine ended the request without output") from None
    except ClientDisconnected:
        timer.finish(None, "abort")
        with anyio.CancelScope(shield=True):
            await release(ctx, prepared.request_id, outputs)
        raise
    if first.finish_reason == "error":
        # Nothing was sent yet, so even a stream gets a real HTTP error status.
        timer.finish(first, "error")
        raise engine_failure(first)
    return Generation(ctx, prepared, outputs, first, timer)


async def start_choices(ctx: ServingContext, http_request: Request,
                        prepared: PreparedRequest) -> Choices:
    """Start every choice of a request at once; if any is refused, none is left running."""
    choices = prepared.choices()
    if len(choices) == 1:
        return Choices([await start_generation(ctx, http_request, prepared)])
    # gather starts its tasks in order, so choice 0 reaches the engine first and the others
    # (share_prompt_with) wait for its prefill.
    started = await asyncio.gather(*(start_generation(ctx, http_request, choice)
                                     for choice in choices), return_exceptions=True)
    failures = [result for result in started if isinstance(result, BaseException)]
    if failures:
        for result in started:
            if isinstance(result, Generation):
                await result.aclose()
        raise failures[0]
    return Choices([result for result in started if isinstance(result, Generation)])


async def collect_choices(http_request: Request, choices: Choices) -> list[list[RequestOutput]]:
    """All outputs of every choice of a non-streaming request; an engine failure is an error."""
    by_choice = await run_until_disconnect(http_request, choices.collect())
    for outputs in by_choice:
        if outputs[-1].finish_reason == "error":
            raise engine_failure(outputs[-1])
    return by_choice


def with_kv_transfer(body: dict[str, Any], final: RequestOutput) -> dict[str, Any]:
    """A prefill instance's answer carries the handle of the KV it holds for a decode
    instance, as a top-level ``kv_transfer_params`` field (vLLM's name for it)."""
    if final.kv_transfer is not None:
        body["kv_transfer_params"] = final.kv_transfer
    return body


# The ``object`` of the events a streamed prefill leg adds for the router (never a client's).
KV_TRANSFER_OBJECT = "slipstream.kv_transfer"


def kv_handle_event(choices: Choices, request_id: str) -> bytes:
    """A streamed prefill leg (``do_remote_decode``): its first event, before any token, is
    the streaming KV handle, so a router can start the decode leg while the prompt is still
    computing (the decode instance reads each chunk's blocks as they are done). Empty for
    every other request."""
    first = choices.generations[0].first
    if first.kv_transfer is None or first.finished:
        return b""
    return sse_event(json.dumps({"id": request_id, "object": KV_TRANSFER_OBJECT,
                                 "kv_transfer_params": first.kv_transfer}))


async def collect_outputs(http_request: Request, generation: Generation) -> list[RequestOutput]:
    """All outputs of a non-streaming request; an engine failure becomes a 500."""
    outputs = await run_until_disconnect(http_request, generation.collect())
    if outputs[-1].finish_reason == "error":
        raise engine_failure(outputs[-1])
    return outputs


# ---- server-sent events -----------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(json_text: str) -> bytes:
    return b"data: " + json_text.encode() + b"\n\n"


async def stream_events(generation: Generation | Choices,
                        render: Callable[[RequestOutput], bytes],
                        usage: Callable[[RequestOutput], bytes] | None,
                        prelude: bytes = b"") -> AsyncIterator[bytes]:
    """The SSE body every streaming endpoint shares: ``prelude`` if any, ``render`` of each
    output that brings tokens or the finish, an engine failure as an error event (which ends
    the stream), the complete KV handle of a prefill leg that handed its KV off (an event of
    ``KV_TRANSFER_OBJECT``), then ``usage`` of the last output when asked for, then
    ``[DONE]``."""
    final: RequestOutput | None = None
    if prelude:
        yield prelude
    async with contextlib.aclosing(generation.__aiter__()) as outputs:
        async for output in outputs:
            final = output
            if output.finish_reason == "error":
                yield sse_event(json.dumps(engine_failure(output).body()))
                break
            if not output.new_token_ids and not output.finished:
                continue
            yield render(output)
    if final is not None and final.finished and final.kv_transfer is not None:
        yield sse_event(json.dumps({"object": KV_TRANSFER_OBJECT,
                                    "kv_transfer_params": final.kv_transfer}))
    if usage is not None and final is not None:
        yield usage(final)
    yield SSE_DONE


# HTTP status for each way the engine ends a request with an error. Only 503 tells a
# router (or a client) to try another instance: the request never ran, or the instance is
# shutting down. A request that broke the engine, or was running when a worker died, is
# not sent elsewhere, where it could do the same again.
_STATUS_BY_ERROR_CODE = {
    errors.INVALID_REQUEST: 400,
    errors.REQUEST_FAILED: 500,
    errors.ENGINE_ERROR: 500,
    errors.ENGINE_DEAD: 500,
    errors.DRAINED: 503,
    errors.SHUTTING_DOWN: 503,
    errors.KV_TRANSFER_FAILED: 503,  # nothing was sent: the router may retry the pair
}


def engine_failure(output: RequestOutput) -> APIError:
    """The error a failed request reports, with the status its error code calls for."""
    code = output.error_code or errors.ENGINE_ERROR
    return APIError(_STATUS_BY_ERROR_CODE.get(code, 500),
                    output.error or "the engine failed while generating", code=code)
