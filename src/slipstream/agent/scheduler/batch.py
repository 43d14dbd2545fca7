"""The one description that crosses from the scheduler to the model runner each iteration.

    Scheduler.schedule() -> Batch (pure Python)
        -> model runner: tensors, attention plan, forward, sampling (torch)
        -> Scheduler.update(batch, sampled tokens)

A ``Batch`` lists decodes first, then prefill chunks. Every item is a ``ScheduledChunk``: a
contiguous run of tokens of one request, starting at ``start_pos`` in its sequence, with the
request's whole block table. A decode is simply a chunk of one token. ``sample`` is set when
the chunk reaches the end of the known tokens, so the runner samples the next token there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.contracts.sampling import SamplingOptions
from slipstream.agent.scheduler.kv_tiers import TierOps


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int  # position of token_ids[0] in the request's sequence
    block_ids: tuple[int, ...]  # the request's full block table after this step's allocation
    sample: bool  # this chunk ends at the last known token: sample the next one
    sampling: SamplingOptions = SamplingOptions()
    num_generated: int = 0  # tokens generated so far; seeds per-position sampling
    # Tokens the penalties look at, set only on sampling chunks of requests that use them:
    # the prompt (with a repetition penalty) followed by the ``num_generated`` output tokens.
    history: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.sample and self.start_pos > 0


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Move KV blocks between device and host memory (swap preemption)."""

    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Batch:
    chunks: tuple[ScheduledChunk, ...]
    swap_out: tuple[BlockCopy, ...] = ()  # device -> host, before the forward
    swap_in: tuple[BlockCopy, ...] = ()  # host -> device, before the forward
    # KV tier copies (kv_tiers.py): spills, offloads before the swap-ins, loads after them,
    # then fetches started in the background; None when no tier asked for any.
    tier_ops: TierOps | None = None
    predicted_time_s: float | None = None  # the packer's prediction, for metrics
    meta: dict = field(default_factory=dict)  # free-form annotations for traces/metrics

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.swap_out and not self.swap_in and not self.tier_ops

    @property
    def num_decodes(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.is_decode)
