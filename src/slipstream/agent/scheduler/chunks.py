"""How a granted request becomes a ``ScheduledChunk`` (batch.py), what the scheduler emits.

A decode chunk is the request's last token at its computed length. A prefill chunk is the next
``size`` tokens still to compute (prompt, or output being recomputed after a preemption) and
samples only if it reaches the end. Penalty histories travel only with chunks that sample, and
only for requests whose sampling uses them.
"""

from __future__ import annotations

from slipstream.agent.scheduler.batch import ScheduledChunk
from slipstream.agent.scheduler.request import Request


def decode_chunk(request: Request) -> ScheduledChunk:
    outputs = request.output_token_ids
    token = outputs[-1] if outputs else request.prompt_token_ids[-1]
    return ScheduledChunk(request.request_id, (token,), request.num_computed_tokens,
                          tuple(request.block_ids), True, request.sampling, len(outputs),
                          penalty_history(request))


def prefill_chunk(request: Request, size: int) -> ScheduledChunk:
    start = request.num_computed_tokens
    end = start + size
    sample = end == request.num_tokens
    return ScheduledChunk(
        request_id=request.request_id,
        token_ids=tuple(request.token_ids(start, end)),
        start_pos=start,
        block_ids=tuple(request.block_ids),
        sample=sample,
        sampling=request.sampling,
        num_generated=request.num_output_tokens,
        history=penalty_history(request) if sample else (),
    )


def penalty_history(request: Request) -> tuple[int, ...]:
    """The tokens a request's penalties count (see ``ScheduledChunk.history``); empty for the
    requests that use none, so they pay nothing."""
    sampling = request.sampling
    if not sampling.uses_output_history:
        return ()
    if sampling.uses_prompt_history:
        return (*request.prompt_token_ids, *request.output_token_ids)
    return tuple(request.output_token_ids)
