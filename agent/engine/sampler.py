"""Token sampling from a step's logits: greedy, temperature, top-k, top-p, seeds, logprobs.

Sampling is batched across requests. A seeded request draws from a generator seeded by
(seed, output position), so its tokens do not depend on what else shares the batch, and a
request resumed after preemption draws exactly what it would have drawn.
Logprobs are of the raw model distribution (before temperature/top-k/top-p), as OpenAI and
vLLM report them.
"""

from __future__ import annotations

import torch

from slipstream.agent.engine.sampling_params import TokenLogprob
from slipstream.agent.scheduler.batch import SamplingOptions

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seeds


def _position_seed(seed: int, position: int) -> int:
    return (seed * _SEED_MIX + position) % (2**63 - 1)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, options: list[SamplingOptions],
                 positions: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
        """``logits`` [rows, vocab] float32; ``positions`` are output indices for seeding."""
        logits = logits.float()
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(o.logprobs is not None for o in options) else None)
        tokens = torch.argmax(logits, dim=-1)
        random_rows = [i for i, o in enumerate(options) if not o.greedy]
        if random_rows:
            probs = _filtered_probs(logits[random_rows], [options[i] for i in random_rows])
            cpu_probs = probs.cpu()
            for row_index, row in enumerate(random_rows):
                seed = options[row].seed
                generator = (torch.Generator().manual_seed(_position_seed(seed, positions[row]))
                             if seed is not None else self.generator)
                tokens[row] = torch.multinomial(cpu_probs[row_index], 1, generator=generator)[0]
        token_list = tokens.tolist()
        return token_list, _logprobs(raw_logprobs, token_list, options)


def _filtered_probs(logits: torch.Tensor, options: list[SamplingOptions]) -> torch.Tensor:
    temperature = torch.tensor([o.temperature for o in options], device=logits.device)
    logits = logits / temperature.unsqueeze(-1)
    needs_top_k = any(o.top_k > 0 for o in options)
    needs_top_p = any(o.top_p < 1.0 for o in options)
    if needs_top_k or needs_top_p:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        top_k = torch.tensor([o.top_k if o.top_k > 0 else vocab for o in options],
                             device=logits.device)
        drop = ranks >= top_k.unsqueeze(-1)
        if needs_top_p:
            sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            top_p = torch.tensor([o.top_p for o in options], device=logits.device)
            drop |= mass_before >= top_p.unsqueeze(-1)  # always keeps the most likely token
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
            values, ids = torch.topk(raw[row], option.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        results.append(TokenLogprob(token, float(raw[row, token]), top))
    return results
