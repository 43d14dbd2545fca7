"""A request's checks before the engine sees it: the model name, the prompt's tokens within
the context, max_tokens, sampling settings and the SLO, into one ``PreparedRequest``.

    body --check_model()--> the served name (404 for another)
    text --tokenize()--> prompt token ids (400 once it cannot fit; long texts off the loop)
    body + prompt ids --prepare()--> PreparedRequest: the EngineRequest (SamplingParams,
        SLO, KV transfer) and n choices

Everything here raises ``APIError`` (a 4xx) for what the client must change; nothing
reaches the engine until it passed. ``generation`` runs what this prepares.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slipstream.contracts.request import EngineRequest, KVTransfer, RequestSLO
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.server.config import ServerConfig
from slipstream.contracts.errors import APIError, bad_request, model_not_found
from slipstream.agent.server.metrics import ServingMetrics
from slipstream.agent.server.protocol import SloSpec, _GenerationRequest
from slipstream.agent.server.tenancy.identity import Caller
from slipstream.agent.server.tenancy.slo_policy import RequestedSlo

if TYPE_CHECKING:
    from slipstream.agent.engine.engine_client import ServingEngine

# Tokenizing more than this many characters moves to a thread, off the event loop.
_TOKENIZE_IN_THREAD_CHARS = 16_384
# After tokenizing a text this long, return freed memory to the OS (release_free_memory).
_TRIM_AFTER_CHARS = 1 << 20
_malloc_trim: Any = None


@dataclass(frozen=True)
class ServingContext:
    """What every step of a request's trip reads: the engine, the metrics, the settings."""

    engine: ServingEngine
    metrics: ServingMetrics
    config: ServerConfig


@dataclass(frozen=True)
class PreparedRequest:
    """A checked request: what the engine takes (``request``), and what only the API
    reads."""

    request: EngineRequest
    include_usage_in_stream: bool
    num_choices: int = 1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def choices(self) -> list[EngineRequest]:
        """One engine request per choice. Choice 0 is this request itself (so ``n=1`` is
        unchanged); choice ``i`` gets its own id and, when seeded, its own seed stream, and
        reuses choice 0's prompt KV (the engine computes the prompt once)."""
        request = self.request
        if self.num_choices == 1:
            return [request]
        result = []
        for index in range(self.num_choices):
            params = request.params
            if params.seed is not None and index:
                params = dataclasses.replace(params, seed=choice_seed(params.seed, index))
            result.append(dataclasses.replace(
                request, request_id=f"{request.request_id}-{index}", params=params,
                share_prompt_with=f"{request.request_id}-0" if index else None))
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
        raise _no_room_for_output(max_model_len, f"more than {cap}", param)
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
            grammar: str | None = None, caller: Caller | None = None) -> PreparedRequest:
    """Check the request against the model's limits and build what the engine takes;
    ``grammar`` (llguidance, already checked) constrains every output. ``caller`` (tenants
    on): the fair queue's tenant, the permitted SLO and the tokens charged come from it."""
    resolved_max_tokens = resolve_max_tokens(ctx, len(prompt_token_ids), max_tokens,
                                             prompt_param, max_tokens_param)
    if body.kv_transfer_params and body.num_choices > 1:
        raise bad_request("kv_transfer_params needs n=1", param="n")
    params = build_sampling_params(body, resolved_max_tokens, logprobs, grammar)
    if caller is None:
        if body.slo is not None and body.slo.class_name is not None:
            raise bad_request("slo.class: SLO classes belong to tenants, and this server has "
                              "no tenants file", param="slo.class")
        app_id, weight = body.app_id or (body.user or "")[:256] or "default", 1.0
        slo = build_slo(body.slo, ctx.config)
    else:
        app_id, weight, slo = _tenant_side(ctx, caller, body)
        caller.charge_tokens(len(prompt_token_ids) + resolved_max_tokens * body.num_choices)
    return PreparedRequest(
        EngineRequest(request_id, prompt_token_ids, params, app_id, body.priority, slo,
                      KVTransfer.from_params(body.kv_transfer_params), share_weight=weight),
        include_usage_in_stream=body.include_usage_in_stream, num_choices=body.num_choices)


def _tenant_side(ctx: ServingContext, caller: Caller, body: _GenerationRequest
                 ) -> tuple[str, float, RequestSLO | None]:
    """The fair queue's tenant, its weight and the SLO the tenant permits (403 for an
    app_id of another tenant, 400 for an SLO class it does not have)."""
    caller.application(body.app_id)
    spec = body.slo
    resolved = caller.resolve_slo(None if spec is None else RequestedSlo(
        spec.class_name, spec.ttft_s, spec.tpot_ms))
    slo = build_slo(SloSpec.model_validate({"ttft_s": resolved.ttft_s,
                                            "tpot_ms": resolved.tpot_ms}), ctx.config)
    return caller.fair_queue_id, caller.weight, slo


def resolve_max_tokens(ctx: ServingContext, num_prompt_tokens: int, requested: int | None,
                       prompt_param: str, max_tokens_param: str = "max_tokens") -> int:
    max_model_len = ctx.engine.max_model_len
    room = max_model_len - num_prompt_tokens
    if requested is not None and requested < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {requested}",
                          param=max_tokens_param)
    if room < 1:
        raise _no_room_for_output(max_model_len, str(num_prompt_tokens), prompt_param)
    if requested is None:
        return min(room, ctx.config.default_max_tokens_cap)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"prompt, {requested} for the completion). Please reduce the prompt or "
            f"{max_tokens_param}.", param=max_tokens_param, code="context_length_exceeded")
    return requested


def _no_room_for_output(max_model_len: int, prompt_tokens: str, param: str) -> APIError:
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt has {prompt_tokens} tokens, which leaves no room for output. Please shorten "
        "the prompt.", param=param, code="context_length_exceeded")


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
