"""The admission checks both serving engines share (``check_admission``): the engine thread
of the server process (``AsyncEngine``) and the API process's end of a separate engine core
(``EngineCoreClient``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine.engine_client import check_admission, dead_output
from slipstream.agent.engine.errors import ENGINE_DEAD, EngineDeadError, EngineUnavailable
from slipstream.agent.engine.limits import RequestLimits
from slipstream.contracts.sampling import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=64, kv_blocks_total=1000)


@dataclass
class Door:
    """The state ``check_admission`` reads, as either serving engine holds it."""

    fatal_error: str | None = None
    draining: bool = False
    healthy: bool = True
    limits: RequestLimits = LIMITS
    in_flight: set[str] = field(default_factory=set)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self.in_flight


def test_a_good_request_is_admitted() -> None:
    check_admission(Door(), EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=8)))


@pytest.mark.parametrize(("door", "error", "words"), [
    (Door(fatal_error="worker 1 died", draining=True, healthy=False), EngineDeadError,
     "failed"),
    (Door(draining=True, healthy=False), EngineUnavailable, "shutting down"),
    (Door(healthy=False), EngineUnavailable, "not running"),
    (Door(in_flight={"a"}), ValueError, "already in flight"),
])
def test_the_first_failing_check_answers(door: Door, error: type[Exception],
                                         words: str) -> None:
    # A bad prompt too: the engine's state is reported first (a 503 before a 400).
    with pytest.raises(error, match=words):
        check_admission(door, EngineRequest("a", [] if door.in_flight else [1],
                                            SamplingParams(max_tokens=8)))


@pytest.mark.parametrize(("prompt", "params", "words"), [
    ([], SamplingParams(), "empty"),
    ([1, 100], SamplingParams(), r"must be in \[0, 100\)"),
    ([1] * 60, SamplingParams(max_tokens=8), "maximum context length is 64"),
    ([1], SamplingParams(stop_token_ids=[100]), "stop_token_ids"),
])
def test_requests_that_can_never_be_served_are_refused(prompt: list[int],
                                                       params: SamplingParams,
                                                       words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_admission(Door(), EngineRequest("a", prompt, params))


def test_limits_cross_to_the_api_process_whole() -> None:
    # The engine core sends its limits in its Ready message; the API process checks with them.
    limits = RequestLimits(100, 64, 1000)
    raw = msgspec.msgpack.encode(limits)
    assert msgspec.msgpack.decode(raw, type=RequestLimits) == limits


def test_a_dead_engine_ends_a_request_with_a_retryable_error() -> None:
    output = dead_output("a")
    assert output.finished and output.finish_reason == "error"
    assert output.error_code == ENGINE_DEAD and "retry" in (output.error or "")
