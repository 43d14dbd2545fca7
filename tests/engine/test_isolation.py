"""One request never hurts another: extreme sampling values sample safely, values the sampler
cannot represent are refused, and a step that still fails fails only its culprit."""

from __future__ import annotations

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.errors import REQUEST_FAILED
from slipstream.agent.engine.sampling.sampler import Sampler, filtered_probs
from slipstream.contracts.sampling import INT64_MAX, SamplingParams
from slipstream.agent.scheduler.batch import Batch
from slipstream.contracts.sampling import SamplingOptions

PROMPTS = [[11, 222, 3333, 44], [5, 6, 7], list(range(100, 140)), [900] * 20, [1, 2],
           [77] * 33, [3, 1, 4, 1, 5, 9, 2, 6], [2718, 28, 18, 28]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True)

# Values that pass validation but once made a batched step raise (or sample garbage).
EXTREME_BUT_VALID = {
    "temperature 1e-30": dict(temperature=1e-30),
    "temperature below float32": dict(temperature=1e-300),
    "smallest double temperature": dict(temperature=5e-324),
    "top_p below float32": dict(top_p=1e-300),
    "smallest double top_p": dict(top_p=5e-324),
    "top_k at int64 max": dict(top_k=INT64_MAX),
    "top_k past the vocabulary": dict(top_k=10**12),
    "seed at int64 max": dict(seed=INT64_MAX),
    "seed at int64 min": dict(seed=-(2**63)),
    "most logprobs": dict(logprobs=20),
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=256))


def run(engine, prompts, params_list):
    """Tokens and final output of each request, in order; KV must be all free at the end."""
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    tokens = {rid: [] for rid in ids}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    assert engine.block_manager.kv_blocks_used == 0
    return [tokens[rid] for rid in ids], [finals[rid] for rid in ids]


@pytest.mark.parametrize("extreme", EXTREME_BUT_VALID.values(), ids=EXTREME_BUT_VALID.keys())
def test_extreme_values_sample_beside_a_batch_that_is_not_disturbed(engine, extreme):
    neighbours = [GREEDY, SEEDED] * 4
    alone, _ = run(engine, PROMPTS, neighbours)
    poison = SamplingParams(**{**dict(max_tokens=10, ignore_eos=True, temperature=1.0),
                               **extreme})
    together, finals = run(engine, PROMPTS + [[42, 43, 44]], neighbours + [poison])
    assert together[:-1] == alone
    assert finals[-1].finish_reason == "length" and len(together[-1]) == 10


@pytest.mark.parametrize("tiny", [dict(temperature=1e-30), dict(temperature=5e-324),
                                  dict(top_p=5e-324)], ids=["temp", "temp-min", "top_p-min"])
def test_vanishing_temperature_or_top_p_is_greedy(engine, tiny):
    greedy, _ = run(engine, [PROMPTS[0]], [GREEDY])
    vanishing, _ = run(engine, [PROMPTS[0]], [SamplingParams(max_tokens=10, ignore_eos=True,
                                                             seed=3, **tiny)])
    assert vanishing == greedy


@pytest.mark.parametrize("fields, message", [
    (dict(top_k=2**63), "top_k"), (dict(top_k=10**30), "top_k"),
    (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=float("inf")), "top_p"),
])
def test_values_the_sampler_cannot_represent_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_out_of_vocabulary_stop_token_ids_are_refused(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.validate([1, 2, 3], SamplingParams(stop_token_ids=(vocab,)))


def test_a_row_of_non_finite_logits_fails_alone():
    logits = torch.randn(4, 50)
    logits[2, 7] = float("nan")
    logits[3] = float("inf")
    options = [SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.7, seed=1),
               SamplingOptions(temperature=0.7, seed=1), SamplingOptions(temperature=0.0)]
    result = Sampler(0)(logits, options, [0, 0, 0, 0])
    assert set(result.errors) == {2, 3}
    assert result.tokens[0] == int(torch.argmax(logits[0]))
    clean = Sampler(0)(logits[:2], options[:2], [0, 0])
    assert result.tokens[:2] == clean.tokens and not clean.errors


def test_filtered_probs_always_keep_the_most_likely_token():
    logits = torch.randn(3, 64) * 50
    options = [SamplingOptions(temperature=5e-324), SamplingOptions(top_p=5e-324),
               SamplingOptions(top_k=INT64_MAX, top_p=1e-300, temperature=1e-300)]
    probs = filtered_probs(logits, options)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(3))
    assert (probs.argmax(dim=-1) == logits.argmax(dim=-1)).all()


class FailingFor:
    """The engine's real runner, made to raise whenever a batch holds a marked request: a
    fault no validation can catch, like a bug that one request's shape triggers."""

    def __init__(self, runner, culprits: set[str]) -> None:
        self._runner = runner
        self.culprits = culprits
        self.calls = 0

    def execute(self, batch: Batch):
        self.calls += 1
        if any(chunk.request_id in self.culprits for chunk in batch.chunks):
            raise RuntimeError("injected fault")
        return self._runner.execute(batch)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def test_a_step_that_raises_fails_only_its_culprit(engine):
    neighbours = [GREEDY, SEEDED] * 4
    alone, _ = run(engine, PROMPTS, neighbours)
    real_runner = engine.runner
    engine.runner = engine.execution.runner = FailingFor(real_runner, {"culprit"})
    try:
        ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, neighbours)]
        engine.add_request([42, 43], GREEDY, request_id="culprit")
        tokens = {rid: [] for rid in ids}
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finals[out.request_id] = out
    finally:
        engine.runner = engine.execution.runner = real_runner
    assert [tokens[rid] for rid in ids] == alone
    assert all(finals[rid].finish_reason == "length" for rid in ids)
    culprit = finals["culprit"]
    assert culprit.finish_reason == "error" and culprit.error_code == REQUEST_FAILED
    assert "injected" not in culprit.error  # the cause is logged, not shown
    assert engine.block_manager.kv_blocks_used == 0


def test_several_culprits_are_all_found(engine):
    real_runner = engine.runner
    faulty = FailingFor(real_runner, {"bad-1", "bad-2"})
    engine.runner = engine.execution.runner = faulty
    try:
        good = [engine.add_request(p, GREEDY) for p in PROMPTS[:6]]
        for name in faulty.culprits:
            engine.add_request([9, 9, 9], GREEDY, request_id=name)
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    finally:
        engine.runner = engine.execution.runner = real_runner
    assert {rid for rid, out in finals.items() if out.finish_reason == "error"} == \
        {"bad-1", "bad-2"}
    assert all(finals[rid].finish_reason == "length" for rid in good)
