"""Request state, owned by the scheduler.

A request is a token sequence (prompt, then generated tokens) whose KV cache is being caught
up: ``num_computed_tokens`` chases ``num_tokens``. There are no prefill or decode phases. A
prefill chunk is a partial grant of the missing tokens, and a decode is a grant of exactly one.
Preemption by recompute just resets ``num_computed_tokens`` to zero and frees the blocks; the
generated tokens stay, so the request resumes where it was and produces the same output.

With prefix caching a request is admitted with its longest cached prefix already computed:
``num_computed_tokens`` starts at a block boundary, and ``block_ids`` begins with shared blocks.

The engine (or the simulator) decides when a request is finished and tells the scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from slipstream.contracts.request import EngineRequest
from slipstream.contracts.request import RequestSLO
from slipstream.contracts.sampling import SamplingOptions


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; no KV blocks held
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted to host memory; resumes without recompute
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine failed while the request was in flight


_NO_SLO = RequestSLO()


@dataclass(eq=False)
class Request:
    """One request's scheduling state. Mutated only by the scheduler."""

    spec: EngineRequest  # what was asked for, unchanged (contracts/request.py)
    arrival_s: float
    sampling: SamplingOptions = field(init=False)  # the runner's part of ``spec.params``

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)  # KV held in host memory (swapped)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Prefix caching (block_manager.py): the hash chain of the full blocks seen so far, how
    # many of this request's blocks are registered in the cache, the prefix found cached at
    # the latest lookup (an estimate while waiting), and at the first admission (the API's
    # cached_tokens).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    prefix_hit_tokens: int = 0
    num_cached_tokens: int = 0
    # KV tiers (kv_tiers.py): of the prefix found at the latest lookup, the time to bring
    # the part held in a lower tier onto the device (the urgency model counts it as work).
    prefix_load_s: float = 0.0
    # Pipelined execution (SPP): a chunk that samples this request's next token is still in
    # the pipeline. The engine sets and clears it; the scheduler grants the request nothing
    # while it is set.
    in_flight: bool = False
    # Set by the scheduler at add(): absolute TTFT deadline and total prefill work (urgency.py).
    ttft_deadline_s: float | None = None
    prefill_work_s: float | None = None
    # Times on the scheduler's clock, filled as the request progresses.
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None

    def __post_init__(self) -> None:
        self.sampling = self.spec.params.options()

    # What was asked for (``spec``). ``share_prompt_with``: while that request prefills,
    # this one is held back; it is queued once those prompt blocks are in the prefix cache,
    # so the prompt is computed once (scheduler.py). ``share_weight``: Justitia's virtual
    # time charges this request's cost divided by it.

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.spec.prompt_token_ids

    @property
    def max_tokens(self) -> int:
        return self.spec.params.max_tokens

    @property
    def app_id(self) -> str:
        return self.spec.app_id

    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def slo(self) -> RequestSLO:
        return self.spec.slo or _NO_SLO

    @property
    def share_prompt_with(self) -> str | None:
        return self.spec.share_prompt_with

    @property
    def share_weight(self) -> float:
        return self.spec.share_weight

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV must exist before the next token can be sampled."""
        return self.prompt_len + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_uncached_tokens(self) -> int:
        """Tokens still to compute, not counting a waiting request's cached prefix."""
        return self.num_tokens - max(self.num_computed_tokens, self.prefix_hit_tokens)

    @property
    def in_prefill(self) -> bool:
        """True while more than one token is missing from the KV cache (prompt or recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of the full sequence (prompt followed by output)."""
        prompt_len = self.prompt_len
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]
