"""Per-iteration engine metrics, fed by ``LLMEngine.on_step`` on the engine thread.

    engine step -> StepStats(batch, clock readings) -> StepMetrics.observe()   (hot path)
    Prometheus scrape -> StepMetrics.collect() -> histogram and counter families

``observe`` runs once per engine iteration, so it does no locking and no label lookups: it
bisects into plain lists that only the engine thread writes. A scrape reads them from another
thread; at worst it sees a step half-recorded, which the next scrape corrects. The histogram
bounds resolve a 50 ms batch-time target and chunk sizes from 32 to 8192 tokens (the packer's
search range).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.agent.engine.step.stats import StepStats, StepSummary
from slipstream.contracts import metric_names as names


def log_spaced_buckets(low: float, high: float, ratio: float = 2 ** 0.5) -> tuple[float, ...]:
    """Bucket bounds from ``low`` growing by ``ratio`` until ``high`` is covered."""
    bounds = [low]
    while bounds[-1] < high:
        bounds.append(bounds[-1] * ratio)
    return tuple(float(f"{bound:.4g}") for bound in bounds)


# 0.25 ms (a CPU tiny model's decode) to ~16 s (a 1M-token late chunk on a slow device).
BATCH_TIME_BUCKETS_S = log_spaced_buckets(0.00025, 16.0)
SCHEDULE_TIME_BUCKETS_S = log_spaced_buckets(0.00001, 1.0, ratio=2.0)
CHUNK_TOKEN_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0,
                       512.0, 768.0, 1024.0, 1536.0, 2048.0, 3072.0, 4096.0, 6144.0, 8192.0,
                       16384.0)


class LockFreeHistogram:
    """Bucket counts written by one thread; the cumulative view is built at scrape time."""

    __slots__ = ("spec", "bounds", "counts", "total")

    def __init__(self, spec: names.MetricSpec, bounds: Sequence[float]) -> None:
        self.spec = spec
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last slot is +Inf only
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self) -> HistogramMetricFamily:
        counts = list(self.counts)  # one consistent copy of the buckets
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family = HistogramMetricFamily(self.spec.name, self.spec.help)
        family.add_metric([], buckets, self.total)
        return family


class StepMetrics(Collector):
    """Chunk sizes, batch sizes, predicted and actual batch time, scheduled tokens by phase."""

    def __init__(self) -> None:
        self.prefill_chunk_tokens = LockFreeHistogram(names.PREFILL_CHUNK_TOKENS,
                                                      CHUNK_TOKEN_BUCKETS)
        self.batch_tokens = LockFreeHistogram(names.BATCH_TOKENS, CHUNK_TOKEN_BUCKETS)
        self.batch_time_actual_s = LockFreeHistogram(names.BATCH_TIME_ACTUAL, BATCH_TIME_BUCKETS_S)
        self.batch_time_predicted_s = LockFreeHistogram(names.BATCH_TIME_PREDICTED,
                                                        BATCH_TIME_BUCKETS_S)
        self.schedule_time_s = LockFreeHistogram(names.SCHEDULE_TIME, SCHEDULE_TIME_BUCKETS_S)
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0

    def observe(self, step: StepStats) -> None:
        """The engine's ``on_step`` observer: one pass over the batch, no allocation."""
        batch = step.batch
        prefill_tokens = decode_tokens = 0
        chunk_tokens = self.prefill_chunk_tokens
        for chunk in batch.chunks:
            num_tokens = len(chunk.token_ids)
            if num_tokens == 1 and chunk.sample and chunk.start_pos:  # ScheduledChunk.is_decode
                decode_tokens += 1
            else:
                prefill_tokens += num_tokens
                chunk_tokens.observe(num_tokens)
        self.prefill_tokens_total += prefill_tokens
        self.decode_tokens_total += decode_tokens
        self.batch_tokens.observe(prefill_tokens + decode_tokens)
        self.batch_time_actual_s.observe(step.execute_end_s - step.execute_start_s)
        self.schedule_time_s.observe(step.execute_start_s - step.schedule_start_s)
        if batch.predicted_time_s is not None:
            self.batch_time_predicted_s.observe(batch.predicted_time_s)

    def observe_summary(self, step: StepSummary) -> None:
        """The same as ``observe``, from a step summarised in an engine-core process."""
        for num_tokens in step.prefill_chunk_tokens:
            self.prefill_chunk_tokens.observe(num_tokens)
        prefill_tokens = sum(step.prefill_chunk_tokens)
        self.prefill_tokens_total += prefill_tokens
        self.decode_tokens_total += step.num_decode_tokens
        self.batch_tokens.observe(prefill_tokens + step.num_decode_tokens)
        self.batch_time_actual_s.observe(step.execute_s)
        self.schedule_time_s.observe(step.schedule_s)
        if step.predicted_time_s is not None:
            self.batch_time_predicted_s.observe(step.predicted_time_s)

    def collect(self) -> Iterator[Metric]:
        for histogram in (self.prefill_chunk_tokens, self.batch_tokens, self.batch_time_actual_s,
                          self.batch_time_predicted_s, self.schedule_time_s):
            yield histogram.family()
        spec = names.SCHEDULED_TOKENS
        tokens = CounterMetricFamily(spec.constructor_name, spec.help, labels=spec.labels)
        tokens.add_metric(["prefill"], self.prefill_tokens_total)
        tokens.add_metric(["decode"], self.decode_tokens_total)
        yield tokens
