"""Runtime predictor: how long one iteration takes, from profile tables (Vidur-style).

    profile dir --load_profile()--> ProfileTables --> RuntimePredictor
        --> BatchTimeEstimate (incremental, used by the packer and the prefill time cache)

One iteration costs, with every term already multiplied by the number of layers:

    overhead (runner + engine host work, a + b * sequences + c * prefill tokens)
             + linear(all tokens in the batch)
             + sum over prefill chunks of prefill_attention(kv cached before the chunk, chunk)
             + decode_attention(decode batch size, KV tokens read by all decodes together)

Linear ops (projections, MLP, norms, rope, KV save) are summed into one table at load, so a
prediction is two or three table look-ups in pure Python: microseconds, no numpy call.

Outside the profiled range the tables are flat, which would be wrong, so we extrapolate:
linear ops grow linearly in tokens; prefill attention grows with the attended pairs
``chunk * (kv + chunk / 2)``; decode attention grows linearly in total KV and, beyond the
largest batch, with the per-request slope of the last two batch sizes. The H100 table is flat
in batch size and grows with KV at about 3 TB/s, so we read its second key as the total KV of
the decode batch; our own profiler measures it that way too.

``TokenBudgetModel`` is the fallback when no profile is configured: time is proportional to
tokens, which turns the time budget back into a plain token budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np

from slipstream.agent.scheduler.profile_table import (
    DEFAULT_CACHE_DIR,
    Grid1D,
    Grid2D,
    ProfileMeta,
    ProfileTables,
    load_profile,
)


class BatchTimeModel(Protocol):
    """Per-iteration cost terms in milliseconds (all layers included)."""

    iteration_overhead_ms: float

    def linear_ms(self, num_tokens: int) -> float: ...

    def prefill_attention_ms(self, kv_before_tokens: int, chunk_tokens: int) -> float: ...

    def decode_attention_ms(self, batch_size: int, kv_total_tokens: int) -> float: ...


class RuntimePredictor:
    """Interpolates profile tables; see the module docstring for the cost formula."""

    def __init__(self, tables: ProfileTables, include_host_overhead: bool = True) -> None:
        meta = tables.meta
        self.meta = meta
        self.num_layers = meta.num_layers
        # With the host terms this predicts a whole engine step (what the packer's budget and
        # the simulator's clock need); without them, ModelRunner.execute alone.
        host = include_host_overhead
        self.iteration_overhead_ms = meta.iteration_overhead_ms + (meta.host_overhead_ms if host
                                                                   else 0.0)
        # Charged once per sequence: with each decode in decode_attention_ms and with each
        # prefill chunk in prefill_attention_ms, so wrappers (KVP, SPP) inherit it.
        self.per_sequence_overhead_ms = meta.per_sequence_overhead_ms + (
            meta.host_per_sequence_ms if host else 0.0)
        self.per_prefill_token_overhead_ms = meta.per_prefill_token_overhead_ms
        self._linear = _sum_linear_ops(tables)
        kv, chunk, prefill_ms = tables.prefill_attention
        self._prefill = Grid2D(kv, chunk, prefill_ms)
        batch, kv_total, decode_ms = tables.decode_attention
        self._decode = Grid2D(batch, kv_total, decode_ms)
        z = self._decode.z
        self._decode_last_batch_slope = np.maximum(z[-1] - z[-2], 0.0) / (batch[-1] - batch[-2])

    @classmethod
    def from_directory(cls, directory: str | Path, meta: ProfileMeta | None = None,
                       cache_dir: Path | None = DEFAULT_CACHE_DIR,
                       include_host_overhead: bool = True) -> RuntimePredictor:
        return cls(load_profile(directory, meta=meta, cache_dir=cache_dir), include_host_overhead)

    def linear_ms(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        table = self._linear
        if num_tokens > table.x_max:
            return table(table.x_max) * num_tokens / table.x_max * self.num_layers
        return table(num_tokens) * self.num_layers

    def prefill_attention_ms(self, kv_before_tokens: int, chunk_tokens: int) -> float:
        if chunk_tokens <= 0:
            return 0.0
        table = self._prefill
        kv_in = min(kv_before_tokens, table.a_max)
        chunk_in = min(chunk_tokens, table.b_max)
        ms = table(kv_in, chunk_in)
        if kv_in < kv_before_tokens or chunk_in < chunk_tokens:
            ms *= _attended_pairs(kv_before_tokens, chunk_tokens) / _attended_pairs(kv_in, chunk_in)
        return (ms * self.num_layers + self.per_sequence_overhead_ms
                + self.per_prefill_token_overhead_ms * chunk_tokens)

    def decode_attention_ms(self, batch_size: int, kv_total_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        table = self._decode
        kv_in = min(kv_total_tokens, table.b_max)
        ms = table(min(batch_size, table.a_max), kv_in)
        if batch_size > table.a_max:
            column = min(int(np.searchsorted(table.b_values, kv_in)), len(table.b_values) - 1)
            ms += (batch_size - table.a_max) * float(self._decode_last_batch_slope[column])
        if kv_total_tokens > kv_in:
            ms *= kv_total_tokens / max(kv_in, 1.0)
        return ms * self.num_layers + self.per_sequence_overhead_ms * batch_size

    @property
    def linear_profiled_max_tokens(self) -> float:
        return self._linear.x_max


class TokenBudgetModel:
    """Time proportional to tokens: ``max_batched_tokens`` tokens take ``target_ms``."""

    def __init__(self, max_batched_tokens: int, target_ms: float) -> None:
        if max_batched_tokens < 1 or target_ms <= 0:
            raise ValueError("max_batched_tokens must be >= 1 and target_ms > 0")
        self.ms_per_token = target_ms / max_batched_tokens
        self.iteration_overhead_ms = 0.0

    def linear_ms(self, num_tokens: int) -> float:
        return max(num_tokens, 0) * self.ms_per_token

    def prefill_attention_ms(self, kv_before_tokens: int, chunk_tokens: int) -> float:
        return 0.0

    def decode_attention_ms(self, batch_size: int, kv_total_tokens: int) -> float:
        return 0.0


class AnalyticModel:
    """A closed-form cost model for tests and quick simulations (no profile needed)."""

    def __init__(self, ms_per_token: float, ms_per_attended_pair: float = 0.0,
                 ms_per_decode_kv_token: float = 0.0, iteration_overhead_ms: float = 0.0) -> None:
        self.ms_per_token = ms_per_token
        self.ms_per_attended_pair = ms_per_attended_pair
        self.ms_per_decode_kv_token = ms_per_decode_kv_token
        self.iteration_overhead_ms = iteration_overhead_ms

    def linear_ms(self, num_tokens: int) -> float:
        return max(num_tokens, 0) * self.ms_per_token

    def prefill_attention_ms(self, kv_before_tokens: int, chunk_tokens: int) -> float:
        return _attended_pairs(kv_before_tokens, chunk_tokens) * self.ms_per_attended_pair

    def decode_attention_ms(self, batch_size: int, kv_total_tokens: int) -> float:
        return kv_total_tokens * self.ms_per_decode_kv_token if batch_size > 0 else 0.0


class BatchTimeEstimate:
    """A batch being packed: running totals, so each what-if costs two table look-ups."""

    __slots__ = ("model", "num_tokens", "prefill_attention_ms", "decode_attention_ms",
                 "num_decodes", "decode_kv_tokens", "load_ms")

    def __init__(self, model: BatchTimeModel) -> None:
        self.model = model
        self.num_tokens = 0
        self.prefill_attention_ms = 0.0
        self.decode_attention_ms = 0.0
        self.num_decodes = 0
        self.decode_kv_tokens = 0
        self.load_ms = 0.0  # KV loaded from a lower tier before the forward (kv_tiers.py)

    def add_decodes(self, count: int, kv_total_tokens: int) -> None:
        self.num_decodes += count
        self.decode_kv_tokens += kv_total_tokens
        self.num_tokens += count
        self.decode_attention_ms = self.model.decode_attention_ms(self.num_decodes,
                                                                  self.decode_kv_tokens)

    def add_prefill(self, kv_before_tokens: int, chunk_tokens: int, load_ms: float = 0.0) -> None:
        self.num_tokens += chunk_tokens
        self.prefill_attention_ms += self.model.prefill_attention_ms(kv_before_tokens, chunk_tokens)
        self.load_ms += load_ms

    @property
    def time_ms(self) -> float:
        if self.num_tokens == 0:
            return 0.0
        return self._total_ms(self.num_tokens, self.prefill_attention_ms)

    def time_with_prefill_ms(self, kv_before_tokens: int, chunk_tokens: int,
                             load_ms: float = 0.0) -> float:
        """The batch time if a chunk (and the load of its lower-tier prefix) were added
        (the packer's what-if)."""
        extra = self.model.prefill_attention_ms(kv_before_tokens, chunk_tokens)
        return self._total_ms(self.num_tokens + chunk_tokens,
                              self.prefill_attention_ms + extra) + load_ms

    def _total_ms(self, num_tokens: int, prefill_attention_ms: float) -> float:
        model = self.model
        return (model.iteration_overhead_ms + model.linear_ms(num_tokens)
                + prefill_attention_ms + self.decode_attention_ms + self.load_ms)


def predict_batch_time_ms(model: BatchTimeModel, prefills: Iterable[tuple[int, int]],
                          decode_kv_lens: Sequence[int]) -> float:
    """Time of one batch: ``prefills`` as (chunk_tokens, kv_len_after), decodes by KV length."""
    estimate = BatchTimeEstimate(model)
    if decode_kv_lens:
        estimate.add_decodes(len(decode_kv_lens), int(sum(decode_kv_lens)))
    for chunk_tokens, kv_len_after in prefills:
        estimate.add_prefill(kv_len_after - chunk_tokens, chunk_tokens)
    return estimate.time_ms


def model_floor_target_ms(model: BatchTimeModel) -> float:
    """The smallest batch-time target this model can be packed under on its device: twice a
    128-token prompt's prefill. Under a smaller target one running decode fills the budget,
    so no prefill chunk fits beside it and new requests wait for the running ones to finish
    (the packer only runs an over-budget chunk in an otherwise empty batch). A ~100M model
    on a CPU core, or any model on a slow device, is there at the usual 50 ms."""
    return 2.0 * predict_batch_time_ms(model, [(128, 128)], [])


def _attended_pairs(kv_before_tokens: float, chunk_tokens: float) -> float:
    """Query-key pairs of a causal chunk over its cached prefix."""
    return chunk_tokens * (kv_before_tokens + chunk_tokens / 2.0)


def _sum_linear_ops(tables: ProfileTables) -> Grid1D:
    if not tables.linear:
        raise ValueError("profile has no linear ops")
    counts = tables.meta.op_counts_per_layer
    ops = sorted(tables.linear)
    tokens = tables.linear[ops[0]][0]
    total = np.zeros_like(tokens, dtype=np.float64)
    for op in ops:
        op_tokens, op_ms = tables.linear[op]
        # Monotone per op first, so one op's wobble cannot hide another's growth.
        total += counts.get(op, 1) * np.interp(tokens, op_tokens, np.maximum.accumulate(op_ms))
    return Grid1D(tokens, total)
