"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, seeds, logprobs.

Sampling is batched across requests. A seeded request draws from a generator seeded by
(seed, output position), so its tokens do not depend on what else shares the batch, and a
request resumed after preemption draws exactly what it would have drawn.
Logprobs are of the raw model distribution (before temperature/top-k/top-p), as OpenAI and
vLLM report them.

Numerical safety: every value that ``SamplingParams`` accepts must sample, whatever shares
the batch. So logits are shifted by their row maximum before the temperature divides them
(the most likely token sits at 0 and cannot overflow; a tiny temperature sends the rest to
-inf, which is greedy, as the limit should be), the temperature never goes below the
smallest positive float32, top-k is clipped to the vocabulary, and top-p always keeps the
most likely token even when the threshold rounds to 0 in float32. A row whose logits are not
finite anyway (a model fault) does not take the batch with it: it is reported in
``SampleResult.errors`` and the other rows are sampled as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.agent.engine.sampling_params import TokenLogprob
from slipstream.agent.scheduler.batch import SamplingOptions

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seeds
_MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def _position_seed(seed: int, position: int) -> int:
    return (seed * _SEED_MIX + position) % (2**63 - 1)


@dataclass
class SampleResult:
    """One token per row, logprobs where asked, and the rows that could not be sampled
    (row index -> why); an errored row's token is meaningless."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    errors: dict[int, str]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, options: list[SamplingOptions],
                 positions: list[int]) -> SampleResult:
        """``logits`` [rows, vocab]; ``positions`` are output indices for seeding."""
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        errors = {row: "the model produced non-finite logits for this request"
                  for row, ok in enumerate(finite) if not ok}
        # Bad rows are sampled from zeros, so nothing below sees a NaN; their tokens are
        # dropped by the caller.
        if errors:
            logits = torch.where(torch.isfinite(logits), logits, torch.zeros_like(logits))
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(o.logprobs is not None for o in options) else None)
        tokens = torch.argmax(logits, dim=-1)
        random_rows = [i for i, o in enumerate(options) if not o.greedy and i not in errors]
        if random_rows:
            probs = filtered_probs(logits[random_rows], [options[i] for i in random_rows])
            cpu_probs = probs.cpu()
            for row_index, row in enumerate(random_rows):
                seed = options[row].seed
                generator = (torch.Generator().manual_seed(_position_seed(seed, positions[row]))
                             if seed is not None else self.generator)
                tokens[row] = torch.multinomial(cpu_probs[row_index], 1, generator=generator)[0]
        token_list = tokens.tolist()
        return SampleResult(token_list, _logprobs(raw_logprobs, token_list, options), errors)


def filtered_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    """The distribution each row samples from, after temperature, top-k and top-p. Every row
    keeps at least its most likely token, so every row sums to 1."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([max(o.temperature, _MIN_TEMPERATURE) for o in options],
                               dtype=torch.float32, device=logits.device)
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    logits = shifted / temperature.unsqueeze(-1)
    needs_top_k = any(0 < o.top_k < vocab for o in options)
    needs_top_p = any(o.top_p < 1.0 for o in options)
    if needs_top_k or needs_top_p:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        top_k = torch.tensor([o.top_k if 0 < o.top_k < vocab else vocab for o in options],
                             device=logits.device)
        drop = ranks >= top_k.unsqueeze(-1)
        if needs_top_p:
            sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            top_p = torch.tensor([o.top_p for o in options], dtype=torch.float32,
                                 device=logits.device)
            drop |= (mass_before >= top_p.unsqueeze(-1)) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def _logprobs(raw: torch.Tensor | None, tokens: list[int],
              options: list[SamplingOptions]) -> list[TokenLogprob | None]:
    if raw is None:
        return [None] * len(tokens)
    results: list[TokenLogprob | None] = []
    for row, (token, option) in enumerate(zip(tokens, options)):
        if option.logprobs is None:
            results.append(None)
            continue
        top: tuple[tuple[int, float], ...] = ()
        if option.logprobs > 0:
            values, ids = torch.topk(raw[row], min(option.logprobs, raw.shape[-1]))
            top = tuple(zip(ids.tolist(), values.tolist()))
        results.append(TokenLogprob(token, float(raw[row, token]), top))
    return results
