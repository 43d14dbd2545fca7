"""Which (length, batch) bucket a batch of fresh short prefills runs in, if any.

    Batch (scheduler) -> short_prefill_lengths(): every chunk a whole fresh prompt?
        -> select_bucket(): the smallest captured (L, B) that holds it, within the padding cap
        -> ShortPrefillExecutor (torch) pads into that bucket's static buffers and replays

Pure Python, so the rule is unit-tested without torch. A short-pool instance (PLA-Serve)
mostly sees batches of whole short prompts; anything else (a decode, a chunk of a longer
prompt, a chunk over cached KV) makes the whole batch take the eager path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slipstream.agent.engine.config import ShortPrefillBuckets
from slipstream.agent.scheduler.batch import ScheduledChunk


@dataclass(frozen=True, order=True)
class PrefillBucket:
    """One static shape: ``batch_size`` rows of ``length_tokens`` tokens each."""

    length_tokens: int
    batch_size: int

    @property
    def padded_tokens(self) -> int:
        return self.length_tokens * self.batch_size


def all_buckets(buckets: ShortPrefillBuckets) -> list[PrefillBucket]:
    return [PrefillBucket(length, batch)
            for length in buckets.lengths_tokens for batch in buckets.batch_sizes]


def short_prefill_lengths(chunks: Sequence[ScheduledChunk]) -> list[int] | None:
    """Prompt lengths when every chunk is a whole fresh prompt (no cached prefix, and it
    samples, so it is not the first piece of a chunked prefill); otherwise None."""
    if not chunks:
        return None
    lengths = []
    for chunk in chunks:
        if chunk.start_pos != 0 or not chunk.sample or chunk.num_tokens == 0:
            return None
        lengths.append(chunk.num_tokens)
    return lengths


def select_bucket(candidates: Sequence[PrefillBucket], prompt_lengths: Sequence[int],
                  max_padding_factor: float) -> PrefillBucket | None:
    """The bucket with the fewest padded tokens that holds every prompt in its own row, or
    None when none does or the best one pads beyond ``max_padding_factor`` x real tokens.
    Ties go to the shorter length (less attention work per row)."""
    if not prompt_lengths:
        return None
    longest, count = max(prompt_lengths), len(prompt_lengths)
    fitting = [bucket for bucket in candidates
               if bucket.length_tokens >= longest and bucket.batch_size >= count]
    if not fitting:
        return None
    best = min(fitting, key=lambda bucket: (bucket.padded_tokens, bucket.length_tokens))
    if best.padded_tokens > max_padding_factor * sum(prompt_lengths):
        return None
    return best
