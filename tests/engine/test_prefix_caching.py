"""Prefix caching on the real (tiny, random-weight) model: greedy outputs are identical with
the cache on and off, whatever the prefixes shared, the chunking and the memory pressure; the
cache is hit, counted, and leaks nothing."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.agent.scheduler.scheduler import SchedulerConfig


def make_engine(model_dir, caching: bool, num_blocks: int = 128, budget: int = 64,
                preemption: str = "recompute") -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=num_blocks),
                     SchedulerConfig(max_batched_tokens=budget, preemption=preemption,
                                     prefix_caching=caching))


def run_rounds(engine: LLMEngine, rounds: list[list[list[int]]], params: SamplingParams):
    """Each round's prompts run together, after the previous round finished, so later rounds
    can hit what earlier ones cached."""
    return [engine.generate(prompts, params) for prompts in rounds]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), num_blocks=st.sampled_from([24, 40, 128]),
       budget=st.sampled_from([5, 16, 37, 128]), preemption=st.sampled_from(["recompute", "swap"]))
def test_property_greedy_output_is_identical_with_and_without_the_cache(
        tiny_model_dir, seed, num_blocks, budget, preemption):
    rng = random.Random(seed)
    documents = [[rng.randrange(4000) for _ in range(rng.randrange(20, 120))] for _ in range(2)]

    def prompt() -> list[int]:
        head = rng.choice(documents)[:rng.randrange(1, 121)]
        return head + [rng.randrange(4000) for _ in range(rng.randrange(1, 20))]

    rounds = [[prompt() for _ in range(rng.randrange(1, 4))] for _ in range(3)]
    params = SamplingParams(max_tokens=rng.randrange(2, 12), temperature=0.0, ignore_eos=True)
    outputs, hits = [], []
    for caching in (False, True):
        engine = make_engine(tiny_model_dir, caching, num_blocks, budget, preemption)
        outputs.append(run_rounds(engine, rounds, params))
        stats = engine.stats()
        hits.append(stats.prefix_cache_hit_tokens)
        assert stats.kv_blocks_used == 0
        assert min(engine.block_manager.device.ref_counts) == 0
    assert outputs[0] == outputs[1]
    assert hits[0] == 0


def test_a_repeated_prompt_reuses_its_blocks_and_reports_cached_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir, caching=True)
    prompt = [(13 * j + 5) % 4000 for j in range(100)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    finals, tokens = [], []
    for _ in range(2):
        request_id = engine.add_request(prompt, params)
        tokens.append([])
        while engine.has_unfinished():
            for output in engine.step():
                tokens[-1].extend(output.new_token_ids)
                if output.finished:
                    finals.append(output)
    cold, warm = finals
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 96  # 6 full blocks of the 100-token prompt
    assert tokens[0] == tokens[1] and len(tokens[0]) == 4
    stats = engine.stats()
    assert stats.prefix_cache_lookup_tokens == 200 and stats.prefix_cache_hit_tokens == 96
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached >= 6


def test_follow_up_on_a_cached_document_computes_only_its_new_tokens(tiny_model_dir):
    engine = make_engine(tiny_model_dir, caching=True, num_blocks=400, budget=512)
    rng = random.Random(7)
    document = [rng.randrange(4000) for _ in range(4096)]
    computed: dict[str, int] = {}
    execute = engine.runner.execute

    def counting_execute(batch):
        for chunk in batch.chunks:
            computed[chunk.request_id] = computed.get(chunk.request_id, 0) + chunk.num_tokens
        return execute(batch)

    engine.runner.execute = counting_execute
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = engine.add_request(document + [11, 12, 13], params)
    while engine.has_unfinished():
        engine.step()
    second = engine.add_request(document + [21, 22, 23, 24, 25], params)
    while engine.has_unfinished():
        engine.step()
    assert computed[first] == 4096 + 3 + 1
    assert computed[second] == 5 + 1  # 4096 document tokens (256 blocks) came from the cache


@pytest.mark.parametrize("caching", [True, False])
def test_no_prefix_caching_flag_turns_it_off(tiny_model_dir, caching):
    engine = make_engine(tiny_model_dir, caching=caching)
    prompt = list(range(1, 3 * BLOCK_SIZE + 2))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], params)
    engine.generate([prompt], params)
    assert (engine.stats().prefix_cache_hit_tokens > 0) is caching
