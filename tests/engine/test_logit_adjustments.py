"""Penalties and logit_bias in the batched sampler, against a plain reference computation of
OpenAI's definitions (and the repetition penalty as transformers defines it)."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.sampling.sampler import (GrammarMasks, Sampler, adjust_logits,
                                                      grammar_penalty)
from slipstream.contracts.sampling import SamplingParams
from slipstream.contracts.sampling import SamplingOptions

VOCAB = 50


def reference(logits: list[float], option: SamplingOptions, history: tuple[int, ...],
              num_output: int) -> list[float]:
    """One row, token by token, straight from the definitions."""
    result = list(logits)
    if option.repetition_penalty != 1.0:
        for token in set(history):
            value = result[token]
            result[token] = (value / option.repetition_penalty if value > 0
                             else value * option.repetition_penalty)
    output = history[len(history) - num_output:] if num_output else ()
    for token in set(output):
        count = output.count(token)
        result[token] -= count * option.frequency_penalty + option.presence_penalty
    for token, bias in option.logit_bias:
        result[token] += bias
    return result


def random_case(rng: random.Random) -> tuple[SamplingOptions, tuple[int, ...], int]:
    penalties = rng.random() < 0.7
    repetition = rng.choice([1.0, 1.0, 1.3, 0.8])
    bias = tuple((token, rng.uniform(-100, 100))
                 for token in rng.sample(range(VOCAB), rng.randint(0, 4)))
    option = SamplingOptions(
        temperature=rng.choice([0.0, 0.7]),
        presence_penalty=rng.uniform(-2, 2) if penalties else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if penalties else 0.0,
        repetition_penalty=repetition, logit_bias=bias)
    num_output = rng.randint(0, 12)
    output = tuple(rng.randrange(VOCAB) for _ in range(num_output))
    prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 8)))
    if not option.uses_output_history:
        return option, (), num_output
    history = (prompt + output) if option.uses_prompt_history else output
    return option, history, num_output


@pytest.mark.parametrize("seed", range(20))
def test_adjusted_logits_match_the_definitions(seed):
    rng = random.Random(seed)
    rows = rng.randint(1, 8)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    cases = [random_case(rng) for _ in range(rows)]
    adjusted = adjust_logits(logits, [c[0] for c in cases], [c[2] for c in cases],
                             [c[1] for c in cases])
    for row, (option, history, num_output) in enumerate(cases):
        expected = reference(logits[row].tolist(), option, history, num_output)
        assert adjusted[row].tolist() == pytest.approx(expected, abs=1e-4), (row, option)


def test_rows_without_adjustments_are_untouched_and_free():
    logits = torch.randn(3, VOCAB)
    options = [SamplingOptions(), SamplingOptions(temperature=0.0), SamplingOptions(top_k=3)]
    assert adjust_logits(logits, options, [0, 5, 2], [(), (), ()]) is logits


def test_grammar_mask_only_touches_its_rows():
    logits = torch.randn(3, VOCAB)
    allowed = torch.zeros(1, VOCAB - 10, dtype=torch.bool)  # narrower than the logits
    allowed[0, [4, 7]] = True
    adjusted = adjust_logits(logits, [SamplingOptions()] * 3, [0, 0, 0], [(), (), ()],
                             GrammarMasks(rows=[1], allowed=allowed))
    assert torch.equal(adjusted[0], logits[0]) and torch.equal(adjusted[2], logits[2])
    finite = torch.isfinite(adjusted[1]).nonzero().flatten().tolist()
    assert finite == [4, 7]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 4096])
def test_bitmask_penalty_matches_the_bits(vocab):
    # llguidance's layout: bit t % 32 of int32 word t // 32 allows token t.
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 - (1 if vocab == 100 else 0)  # 100: narrower than the vocab
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32,
                            generator=generator)
    bitmask[0] = -1  # everything
    bitmask[1] = 0  # nothing
    penalty = grammar_penalty(bitmask, vocab)
    assert penalty.shape == (3, vocab)
    for row in range(3):
        for token in range(vocab):
            word = token // 32
            allowed = word < words and (int(bitmask[row, word]) >> (token % 32)) & 1
            assert penalty[row, token].item() == (0.0 if allowed else float("-inf")), \
                (row, token)


def test_masks_on_every_row_and_with_penalties_leave_the_input_alone():
    logits = torch.randn(2, 64)
    before = logits.clone()
    bitmask = torch.tensor([[0b1010, 0], [0, -(1 << 31)]], dtype=torch.int32)  # bit 31: token 63
    options = [SamplingOptions(), SamplingOptions(logit_bias=((63, 5.0),))]
    for opts in ([SamplingOptions()] * 2, options):
        adjusted = adjust_logits(logits, opts, [0, 0], [(), ()],
                                 GrammarMasks(rows=[0, 1], allowed=bitmask))
        assert torch.equal(logits, before)  # a new tensor; the raw logits serve logprobs
        assert torch.isfinite(adjusted[0]).nonzero().flatten().tolist() == [1, 3]
        assert torch.isfinite(adjusted[1]).nonzero().flatten().tolist() == [63]
    assert adjusted[1, 63].item() == pytest.approx(logits[1, 63].item() + 5.0)


def test_sampler_obeys_bias_and_masks_in_a_mixed_batch():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    options = [SamplingOptions(temperature=0.0, logit_bias=((13, 100.0),)),
               SamplingOptions(temperature=1.0, seed=5, logit_bias=((21, 100.0),)),
               SamplingOptions(temperature=0.0),
               SamplingOptions(temperature=1.0, seed=6)]
    allowed = torch.zeros(1, VOCAB, dtype=torch.bool)
    allowed[0, 42] = True
    result = Sampler()(logits, options, [0, 0, 0, 0], None,
                       lambda: GrammarMasks(rows=[3], allowed=allowed))
    assert result.tokens[0] == 13 and result.tokens[1] == 21 and result.tokens[3] == 42
    assert result.tokens[2] == int(torch.argmax(logits[2]))
    assert not result.errors


# ---- through the engine: the history the sampler sees is the request's real history -----

@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=256))


def test_engine_passes_each_request_its_own_history(engine, monkeypatch):
    sampler = engine.runner.sampler
    seen: list[tuple[list[SamplingOptions], list[int], list[tuple[int, ...]]]] = []
    real_call = Sampler.__call__

    def recording(self, logits, options, positions, histories=None, masks=None):
        seen.append((list(options), list(positions), list(histories or [])))
        return real_call(self, logits, options, positions, histories, masks)

    monkeypatch.setattr(Sampler, "__call__", recording)
    prompts = [[11, 22, 33, 44], [5, 6, 7], [900, 901]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             frequency_penalty=0.5),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             repetition_penalty=1.2),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert sampler is engine.runner.sampler
    freq_rows = rep_rows = plain_rows = 0
    for options, positions, histories in seen:
        for option, position, history in zip(options, positions, histories):
            if option.frequency_penalty:
                assert history == tuple(outputs[ids[0]][:position])
                freq_rows += 1
            elif option.repetition_penalty != 1.0:
                assert history == tuple(prompts[1] + outputs[ids[1]][:position])
                rep_rows += 1
            else:
                assert history == ()
                plain_rows += 1
    assert freq_rows == rep_rows == plain_rows == 6


def test_logit_bias_forces_and_bans_tokens_through_the_engine(engine):
    forced = engine.generate([[1, 2, 3]], SamplingParams(
        max_tokens=5, temperature=0.9, seed=3, ignore_eos=True, logit_bias=((77, 100.0),)))
    assert forced == [[77] * 5]
    greedy = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0,
                                                         ignore_eos=True))[0]
    banned = engine.generate([[1, 2, 3]], SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True,
        logit_bias=tuple((t, -100.0) for t in set(greedy))))[0]
    assert not set(banned) & set(greedy)


def test_penalties_reduce_repetition_of_a_greedy_loop(engine):
    """Greedy decoding of the random model repeats tokens; the maximal penalties make
    repeats costlier, so the output uses more distinct tokens."""
    prompt = [[40, 41, 42]]
    plain = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0,
                                                   ignore_eos=True))[0]
    assert len(set(plain)) < len(plain)  # the loop the penalties should loosen
    penalised = engine.generate(prompt, SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
        frequency_penalty=2.0))[0]
    assert len(set(penalised)) > len(set(plain))
