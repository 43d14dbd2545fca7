"""Prefill time cache (Medha Algorithm 3): how long a prefill of ``l`` tokens takes alone.

    predictor + packer config --> PrefillTimeCache --> urgency.py (deadlines, slack) --> policies

``T(l)`` is the time to prefill ``l`` tokens with adaptive chunking at the target batch time:
each chunk is the largest the packer would choose for an otherwise empty batch at the KV
length reached so far. The cache holds ``T`` every ``step_tokens`` (256) tokens; lengths in
between are interpolated. The remaining prefill time of a request is ``T(p) - T(processed)``,
divided by the SPP degree because SPP keeps that many chunks of one prefill in flight.

The chunk sequence for a prefill of ``l`` tokens is the same as for any longer one up to the
last chunk, which is just cut short. So one simulation, extended on demand to the longest
prompt seen, yields every ``T(l)``: building a 1M-token cache costs one pass, not a pass per
entry.
"""

from __future__ import annotations

import bisect

from slipstream.agent.scheduler.packer import FLOAT_SLACK, PackerConfig, largest_chunk_tokens
from slipstream.agent.scheduler.predictor import BatchTimeModel


class PrefillTimeCache:
    def __init__(self, model: BatchTimeModel, config: PackerConfig, step_tokens: int = 256,
                 spp_degree: int = 1) -> None:
        if step_tokens < 1 or spp_degree < 1:
            raise ValueError("step_tokens and spp_degree must be >= 1")
        self.model = model
        self.config = config
        self.step_tokens = step_tokens
        self.spp_degree = spp_degree
        # The simulated prefill: chunk k starts at _chunk_starts[k] after _chunk_start_ms[k].
        self._chunk_starts: list[int] = [0]
        self._chunk_start_ms: list[float] = [0.0]
        self._grid_ms: list[float] = [0.0]  # T(i * step_tokens)

    def chunk_time_ms(self, kv_before_tokens: int, chunk_tokens: int) -> float:
        model = self.model
        return (model.iteration_overhead_ms + model.linear_ms(chunk_tokens)
                + model.prefill_attention_ms(kv_before_tokens, chunk_tokens))

    def total_s(self, num_tokens: int) -> float:
        """``T(num_tokens)`` in seconds, already divided by the SPP degree."""
        if num_tokens <= 0:
            return 0.0
        index, offset = divmod(num_tokens, self.step_tokens)
        self._extend_grid(index + 1)
        low = self._grid_ms[index]
        if offset == 0:
            return low / 1000.0 / self.spp_degree
        high = self._grid_ms[index + 1]
        ms = low + (high - low) * offset / self.step_tokens
        return ms / 1000.0 / self.spp_degree

    def remaining_s(self, total_tokens: int, processed_tokens: int) -> float:
        return max(0.0, self.total_s(total_tokens) - self.total_s(processed_tokens))

    @property
    def cached_tokens(self) -> int:
        return (len(self._grid_ms) - 1) * self.step_tokens

    def _extend_grid(self, index: int) -> None:
        grid = self._grid_ms
        while len(grid) <= index:
            grid.append(self._simulated_ms(len(grid) * self.step_tokens))

    def _simulated_ms(self, num_tokens: int) -> float:
        """``T(num_tokens)`` in ms from the chunk sequence, extending it as needed."""
        starts = self._chunk_starts
        while starts[-1] < num_tokens:
            kv = starts[-1]
            size = self._chunk_at(kv)
            self._chunk_start_ms.append(self._chunk_start_ms[-1] + self.chunk_time_ms(kv, size))
            starts.append(kv + size)
        k = bisect.bisect_right(starts, num_tokens) - 1
        if starts[k] == num_tokens:
            return self._chunk_start_ms[k]
        return self._chunk_start_ms[k] + self.chunk_time_ms(starts[k], num_tokens - starts[k])

    def _chunk_at(self, kv_before_tokens: int) -> int:
        target_ms = self.config.target_batch_time_ms * (1.0 + FLOAT_SLACK)
        size = largest_chunk_tokens(
            lambda c: self.chunk_time_ms(kv_before_tokens, c) <= target_ms,
            remaining_tokens=self.config.max_chunk_tokens,
            cap_tokens=self.config.max_chunk_tokens,
            config=self.config,
        )
        # A chunk over budget even at the minimum still has to run for the prefill to finish.
        return size or self.config.min_chunk_tokens
