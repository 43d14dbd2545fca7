"""Running ``LLMEngine`` to completion outside a serving loop, through its public loop
(``add_request``, ``step``, ``idle_wait_s``): the warm-up request an instance serves before it
says it is ready, and offline generation (tests, benchmarks, the profiler).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from slipstream.agent.engine.step.load_window import LoadWindow
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.request import FinishReason

if TYPE_CHECKING:
    from slipstream.agent.engine.engine import LLMEngine

# The warm-up request; a generous bound, for a loaded machine or a first CUDA call.
WARM_UP_REQUEST_ID = "slipstream-warm-up"
WARM_UP_TIMEOUT_S = 300.0


def warm_up(engine: LLMEngine, timeout_s: float = WARM_UP_TIMEOUT_S) -> None:
    """``LLMEngine.warm_up``: run one real one-token request through every rank and wait
    for its token, so that an instance says it is ready only once it has served. Raises
    ``EngineDeadError`` if a worker is gone, ``RuntimeError`` if the step fails or takes
    longer than ``timeout_s``. Leaves no trace: step observers are not told, and the load
    window starts afresh."""
    on_step, engine.on_step = engine.on_step, None
    try:
        request_id = engine.add_request([0], SamplingParams(max_tokens=1, temperature=0.0,
                                                            ignore_eos=True),
                                        WARM_UP_REQUEST_ID)
        deadline = engine.clock() + timeout_s
        final: RequestOutput | None = None
        while final is None:
            if engine.clock() > deadline:
                engine.abort(request_id)
                raise RuntimeError(f"the engine did not complete a one-token request in "
                                   f"{timeout_s:.0f} s")
            final = next((out for out in engine.step() if out.finished), None)
            if final is None and (wait_s := engine.idle_wait_s()) > 0:
                time.sleep(wait_s)
        if final.finish_reason == FinishReason.ERROR.value:
            raise RuntimeError(f"the engine failed its warm-up request: {final.error}")
    finally:
        engine.on_step = on_step
    engine.load = LoadWindow(start_s=engine.clock())


def generate(engine: LLMEngine, prompts: list[list[int]],
             params: SamplingParams) -> list[list[int]]:
    """``LLMEngine.generate``: the generated token ids of each prompt, in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        if engine.has_unfinished() and (wait_s := engine.idle_wait_s()) > 0:
            time.sleep(wait_s)  # nothing to add here, so no request can cut the wait short
    return [tokens[rid] for rid in ids]
