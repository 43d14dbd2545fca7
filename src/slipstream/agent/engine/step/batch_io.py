"""A batch's tensors in and its tokens out: the flat token ids and positions every runner feeds
the model (``FlatInputs``, shared with the pipeline stages), and the sampled token of each
chunk that ends a prompt or decodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.agent.engine.sampling.sampler import MaskSource, SampleResult, Sampler
from slipstream.agent.engine.sampling.params import TokenLogprob
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None  # this request could not be sampled; the engine fails it alone


def sampled_tokens(chunks: list[ScheduledChunk], result: SampleResult) -> dict[str, SampledToken]:
    """The sampler's rows, keyed by request; a row it could not sample carries its error."""
    return {chunk.request_id: SampledToken(token, logprob, result.errors.get(row))
            for row, (chunk, token, logprob) in enumerate(zip(chunks, result.tokens,
                                                              result.logprobs))}


@dataclass(frozen=True)
class FlatInputs:
    """A batch flattened into one token row per scheduled token (shared by ``ModelRunner``
    and the parallel ``StageRunner``): ids, positions, and for each chunk that samples,
    ``(chunk index, row of its last token)``."""

    token_ids: list[int]
    positions: list[int]
    sample_rows: list[tuple[int, int]]

    @staticmethod
    def of(chunks: tuple[ScheduledChunk, ...]) -> FlatInputs:
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[tuple[int, int]] = []
        for index, chunk in enumerate(chunks):
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            if chunk.sample:
                sample_rows.append((index, len(token_ids) - 1))
        return FlatInputs(token_ids, positions, sample_rows)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(self.token_ids, dtype=torch.int64, device=device),
                torch.tensor(self.positions, dtype=torch.int64, device=device))


def sample_batch(sampler: Sampler, batch: Batch, sample_rows: list[tuple[int, int]],
                 logits: torch.Tensor, masks: MaskSource | None = None
                 ) -> dict[str, SampledToken]:
    """Sample the next token of every chunk in ``sample_rows`` from its row of ``logits``;
    ``masks`` gives the grammar masks of the guided rows (see ``Sampler``)."""
    if not sample_rows:
        return {}
    chunks = [batch.chunks[index] for index, _ in sample_rows]
    return sampled_tokens(chunks, sampler(logits, [c.sampling for c in chunks],
                                          [c.num_generated for c in chunks],
                                          [c.history for c in chunks], masks))
