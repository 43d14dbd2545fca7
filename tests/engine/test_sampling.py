"""Sampling through the whole engine: seeds, top-k/top-p, logprobs, stop conditions."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.sampling.sampler import NON_FINITE_ERROR, Sampler
from slipstream.contracts.sampling import SamplingOptions, SamplingParams

PROMPT = [11, 222, 3333, 44, 555, 66]
OTHERS = [[5, 6, 7], list(range(100, 140)), [900] * 20]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=256))


def run(engine, prompts, params_list):
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    outputs = {rid: [] for rid in ids}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
            if out.finished:
                finals[out.request_id] = out
    assert engine.block_manager.kv_blocks_used == 0
    return [outputs[rid] for rid in ids], [finals[rid] for rid in ids]


def tokens_of(outputs):
    return [t for out in outputs for t in out.new_token_ids]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    params = SamplingParams(max_tokens=20, temperature=1.3, seed=1234, ignore_eos=True)
    alone, _ = run(engine, [PROMPT], [params])
    crowded, _ = run(engine, [PROMPT] + OTHERS,
                     [params] + [SamplingParams(max_tokens=20, temperature=0.8)] * 3)
    assert tokens_of(alone[0]) == tokens_of(crowded[0])
    other_seed, _ = run(engine, [PROMPT], [SamplingParams(max_tokens=20, temperature=1.3,
                                                          seed=99, ignore_eos=True)])
    assert tokens_of(other_seed[0]) != tokens_of(alone[0])


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True),
], ids=["top_k=1", "top_p~0"])
def test_degenerate_filters_equal_greedy(engine, params):
    greedy, _ = run(engine, [PROMPT], [SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True)])
    filtered, _ = run(engine, [PROMPT], [params])
    assert tokens_of(filtered[0]) == tokens_of(greedy[0])


def test_top_k_only_picks_among_the_k_most_likely(engine):
    params = SamplingParams(max_tokens=30, temperature=5.0, top_k=3, seed=7, logprobs=3,
                            ignore_eos=True)
    outputs, _ = run(engine, [PROMPT], [params])
    entries = [lp for out in outputs[0] for lp in out.logprobs]
    assert len(entries) == 30
    for entry in entries:
        assert entry.token_id in [token for token, _ in entry.top]
    # A high temperature with three candidates should not always pick the top one.
    assert any(entry.token_id != entry.top[0][0] for entry in entries)


def test_logprobs_are_normalised_and_sorted(engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs, _ = run(engine, [PROMPT], [params])
    for entry in (lp for out in outputs[0] for lp in out.logprobs):
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        assert entry.token_id == entry.top[0][0]  # greedy picks the most likely token
        assert math.isclose(entry.logprob, values[0], abs_tol=1e-6)
        assert all(v <= 0 for v in values) and sum(math.exp(v) for v in values) <= 1 + 1e-5


class _Reads:
    """Counts the reads of a tensor back to the host (each is a device sync on a GPU)."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__float__", "__int__")

    def __enter__(self):
        self.calls: list[str] = []
        self.originals = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, self._counted(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, name, original):
        def counted(tensor, *args, **kwargs):
            self.calls.append(name)
            return original(tensor, *args, **kwargs)
        return counted


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logprob_rows_come_back_in_the_steps_one_copy(device):
    """However many rows ask for logprobs, the tokens, flags and logprobs are one read (on
    a CPU the finite flags are read first, which costs nothing there), and the values are
    the log-softmax's own."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=generator).to(device)
    logits[4, 7] = float("nan")
    options = [SamplingOptions(temperature=0.0, logprobs=5), SamplingOptions(temperature=0.0),
               SamplingOptions(temperature=0.9, seed=3, logprobs=2),
               SamplingOptions(temperature=0.0, logprobs=0),
               SamplingOptions(temperature=0.0, logprobs=1),
               SamplingOptions(temperature=1.0, top_k=4, seed=8, logprobs=20)]
    with _Reads() as reads:
        result = Sampler()(logits, options, positions=[0] * 6)
    assert len(reads.calls) == (2 if device == "cpu" else 1), reads.calls
    assert result.errors == {4: NON_FINITE_ERROR}
    expected = torch.log_softmax(logits.float().cpu(), dim=-1)
    assert result.logprobs[1] is None and result.logprobs[3].top == ()
    assert result.tokens[0] == int(expected[0].argmax())
    for row in (0, 2, 3, 5):
        entry, wanted = result.logprobs[row], options[row].logprobs
        assert entry.token_id == result.tokens[row]
        assert entry.logprob == pytest.approx(float(expected[row, entry.token_id]), abs=1e-6)
        values, ids = torch.topk(expected[row], wanted)
        assert [token for token, _ in entry.top] == ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert result.tokens[5] in [token for token, _ in result.logprobs[5].top[:4]]


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_distribution_and_never_pick_a_zero(seeded):
    """The inverse-CDF draw: over 4,000 rows of one distribution (at temperature 1, with a
    token of probability 0 and top-k), each token's frequency is within 4.5 standard deviations of its
    probability; nothing outside the top-k is drawn."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    # A logit of -1e4 has probability 0 in float32 (-inf would be a model fault).
    logits = probs.log().clamp(min=-1e4).repeat(4000, 1)
    logits[:, 5] = math.log(0.04)  # the fifth most likely: outside the top 4, never drawn
    rows = logits.shape[0]
    options = [SamplingOptions(temperature=1.0, top_k=4, seed=row if seeded else None)
               for row in range(rows)]
    result = Sampler(seed=11)(logits, options, positions=[0] * rows)
    counts = torch.bincount(torch.tensor(result.tokens), minlength=6).double()
    expected = probs.double() * rows
    spread = (expected * (1 - probs.double())).sqrt()
    assert counts[1] == 0 and counts[5] == 0
    assert result.errors == {}
    assert ((counts - expected).abs() <= 4.5 * spread).all(), counts.tolist()


def test_stop_token_max_tokens_and_stop_string(engine):
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs, finals = run(engine, [PROMPT], [greedy])
    tokens = tokens_of(outputs[0])
    assert len(tokens) == 16 and finals[0].finish_reason == "length"
    text = "".join(out.new_text for out in outputs[0])

    stop_at = tokens[5]
    _, finals = run(engine, [PROMPT], [SamplingParams(max_tokens=16, temperature=0.0,
                                                      ignore_eos=True,
                                                      stop_token_ids=(stop_at,))])
    assert finals[0].finish_reason == "stop"
    assert finals[0].num_output_tokens == tokens.index(stop_at) + 1

    stop_string = text.strip()[3:7]
    if not stop_string.strip():
        pytest.skip("generated text has no usable stop string")
    outputs, finals = run(engine, [PROMPT], [SamplingParams(max_tokens=16, temperature=0.0,
                                                            ignore_eos=True,
                                                            stop=(stop_string,))])
    streamed = "".join(out.new_text for out in outputs[0])
    assert finals[0].finish_reason == "stop"
    assert stop_string not in streamed and text.startswith(streamed)
    assert streamed == text[: text.index(stop_string)]


def test_invalid_requests_are_rejected_before_queueing(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([10**9], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not engine.has_unfinished()


@pytest.mark.gpu
def test_sampling_on_cuda_keeps_the_draw_on_the_device_and_reads_back_once():
    import torch

    from slipstream.agent.engine.sampling.sampler import NON_FINITE_ERROR, Sampler
    from slipstream.contracts.sampling import SamplingOptions

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50_000, generator=generator).cuda()
    logits[2, 7] = float("nan")
    seeded = SamplingOptions(temperature=0.8, seed=5)
    options = [seeded, SamplingOptions(temperature=0.0), SamplingOptions(temperature=1.0),
               SamplingOptions(temperature=1.0, top_p=0.5)]
    sampler = Sampler(0)
    first = sampler(logits, options, [3, 3, 3, 3])
    assert first.errors == {2: NON_FINITE_ERROR}
    assert first.tokens[1] == int(logits[1].argmax())
    assert all(0 <= token < 50_000 for token in first.tokens)
    # A seeded row draws the same token at the same position, whatever shares the batch.
    alone = Sampler(1)(logits[:1], [seeded], [3])
    assert alone.tokens[0] == first.tokens[0]


def test_the_engine_schedules_the_request_it_was_given(engine):
    """The scheduler's request holds the ``EngineRequest`` the API built, not a copy."""
    spec = EngineRequest("held", list(PROMPT), SamplingParams(max_tokens=2), app_id="a")
    engine.add(spec)
    try:
        assert engine.scheduler.requests["held"].spec is spec
    finally:
        engine.abort("held")
    assert not engine.has_unfinished()
