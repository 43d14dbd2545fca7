"""The part of a request's trip shared by completions and chat: engine call, outputs, teardown.

    validated request -> prepare() (server/prepare.py): model name, context limits,
        SamplingParams, SLO
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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine import errors
from slipstream.agent.engine.errors import EngineUnavailable
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.contracts.errors import APIError, bad_request
from slipstream.agent.server.metrics import RequestTimer
from slipstream.agent.server.prepare import PreparedRequest, ServingContext

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


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

    def __init__(self, ctx: ServingContext, request: EngineRequest,
                 outputs: AsyncIterator[RequestOutput], first: RequestOutput,
                 timer: RequestTimer) -> None:
        self._ctx = ctx
        self._request = request
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
                    await release(self._ctx, self._request.request_id, self._outputs)

    async def collect(self) -> list[RequestOutput]:
        async with contextlib.aclosing(self.__aiter__()) as outputs:
            return [output async for output in outputs]

    async def aclose(self) -> None:
        """Give up on a generation that will not be iterated (another choice failed)."""
        self._timer.finish(None, "abort")
        with anyio.CancelScope(shield=True):
            await release(self._ctx, self._request.request_id, self._outputs)


class Choices:
    """The generations of one request's ``n`` choices; choice ``i`` is ``generations[i]``.
    Iterating yields every choice's outputs as they come (``index_of`` tells whose)."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations
        self.index_of = {g._request.request_id: i for i, g in enumerate(generations)}
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
                           request: EngineRequest) -> Generation:
    """Submit to the engine and wait for its first output (or its refusal)."""
    try:
        outputs = ctx.engine.generate(request)
    except ValueError as error:
        raise bad_request(str(error)) from None
    except EngineUnavailable as error:
        raise APIError(503, str(error), code="engine_unavailable") from None
    timer = ctx.metrics.start_request(len(request.prompt_token_ids), request.slo)
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
            await release(ctx, request.request_id, outputs)
        raise
    if first.finish_reason == "error":
        # Nothing was sent yet, so even a stream gets a real HTTP error status.
        timer.finish(first, "error")
        raise engine_failure(first)
    return Generation(ctx, request, outputs, first, timer)


async def start_choices(ctx: ServingContext, http_request: Request,
                        prepared: PreparedRequest) -> Choices:
    """Start every choice of a request at once; if any is refused, none is left running."""
    choices = prepared.choices()
    if len(choices) == 1:
        return Choices([await start_generation(ctx, http_request, choices[0])])
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
