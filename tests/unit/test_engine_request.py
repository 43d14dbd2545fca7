"""One request type from ``prepare()`` to the scheduler (``EngineRequest``): it crosses the
engine-core transport as it is, msgspec checks its types and its sampling settings on the way
in, and the scheduler's ``Request`` holds it rather than a copy of its fields."""

from __future__ import annotations

import msgspec
import pytest

from slipstream.contracts.request import EngineRequest, KVTransfer, RequestSLO
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.engine_loop import Add
from slipstream.agent.scheduler.request import Request
from slipstream.agent.server.core_messages import command_decoder, encoder

HANDLE = {"transfer_id": "t1", "block_ids": [3, 4], "layout": {"block_size": 16}}


def _request(**fields) -> EngineRequest:
    return EngineRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4, stop=("x",), seed=-3),
                         app_id="search", priority=2, slo=RequestSLO(ttft_s=0.5),
                         share_weight=2.0, **fields)


@pytest.mark.parametrize("kv_transfer", [None, KVTransfer(remote_decode=True),
                                         KVTransfer(handle=HANDLE)])
def test_the_request_crosses_to_the_engine_core_unchanged(kv_transfer):
    request = _request(kv_transfer=kv_transfer)
    decoded = command_decoder.decode(encoder.encode(Add(request, client=2)))
    assert isinstance(decoded, Add) and decoded.client == 2
    assert decoded.request == request
    assert isinstance(decoded.request.params, SamplingParams)
    assert decoded.request.kv_transfer == kv_transfer


def test_a_mistyped_request_is_refused_on_the_way_in():
    def add(prompt, params) -> bytes:
        return msgspec.msgpack.encode(["add", {"request_id": "r1", "prompt_token_ids": prompt,
                                               "params": params}, 0])

    raw = add("not a token list", {"max_tokens": 4})
    with pytest.raises(msgspec.ValidationError, match="prompt_token_ids"):
        command_decoder.decode(raw)
    # SamplingParams checks itself when decoded, as when built.
    raw = add([1], {"max_tokens": 0})
    with pytest.raises(msgspec.ValidationError, match="max_tokens must be at least 1"):
        command_decoder.decode(raw)


@pytest.mark.parametrize(("params", "expected"), [
    (None, None),
    ({}, None),
    ({"something": "else"}, None),
    ({"do_remote_decode": True}, KVTransfer(remote_decode=True)),
    ({**HANDLE, "do_remote_prefill": True},
     KVTransfer(handle={**HANDLE, "do_remote_prefill": True})),
])
def test_kv_transfer_params_become_a_kv_transfer(params, expected):
    assert KVTransfer.from_params(params) == expected


def test_the_scheduler_request_holds_the_engine_request():
    spec = _request()
    request = Request(spec, arrival_s=1.0)
    assert request.spec is spec and request.prompt_token_ids is spec.prompt_token_ids
    assert (request.request_id, request.max_tokens, request.app_id, request.priority,
            request.share_weight) == ("r1", 4, "search", 2, 2.0)
    assert request.slo == RequestSLO(ttft_s=0.5)
    assert request.sampling == spec.params.options()
    # No SLO asked for: the engine's defaults (an empty RequestSLO), as before.
    assert Request(EngineRequest("r2", [1], SamplingParams()), 0.0).slo == RequestSLO()
