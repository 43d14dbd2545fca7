"""Grammars with parallel workers (real worker processes, gloo on CPU): the controller keeps
the matchers and sends each step's masks to the sampler rank, so a guided request's output
parses, validates and equals the single-process output, and a request without a grammar in
the same batches is untouched. The tiny model's weights are random: only the masks can make
its output valid JSON."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.sampling.grammar import json_schema_grammar
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.parallel.compose import build_engine
from slipstream.agent.scheduler.scheduler import SchedulerConfig

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
# Two guided requests (greedy, and sampled with a seed) and a plain one, sharing batches;
# the prompts are long enough for a few 32-token chunks, so prefill chunks and decodes mix.
PROMPTS = [[(13 * i + 5 * j + 3) % 4000 for j in range(40 + 25 * i)] for i in range(3)]
PARAMS = [SamplingParams(max_tokens=300, temperature=0.0, grammar=GRAMMAR),
          SamplingParams(max_tokens=300, temperature=1.0, seed=7, grammar=GRAMMAR),
          SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]


def make_engine(model_dir, parallel: ParallelConfig) -> LLMEngine:
    return build_engine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=96,
                                     parallel=parallel),
                        SchedulerConfig(max_batched_tokens=32))


def run(engine: LLMEngine, prompts=PROMPTS, params=PARAMS):
    """Texts, tokens and finish reasons in request order, and whether some step ran a guided
    and a plain request together."""
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    guided = {rid for rid, p in zip(ids, params) if p.grammar is not None}
    text = {rid: "" for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finish: dict[str, str | None] = {}
    mixed = False
    while engine.has_unfinished():
        live = {rid for rid in ids if rid not in finish}
        mixed |= bool(live & guided) and bool(live - guided)
        for out in engine.step():
            text[out.request_id] += out.new_text
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        if engine.has_unfinished() and (wait_s := engine.idle_wait_s()) > 0:
            time.sleep(wait_s)
    return ([text[r] for r in ids], [tokens[r] for r in ids], [finish[r] for r in ids],
            mixed)


@pytest.fixture(scope="module")
def single_process(tiny_model_dir):
    engine = make_engine(tiny_model_dir, ParallelConfig())
    try:
        texts, tokens, finishes, _ = run(engine)
    finally:
        engine.close()
    assert finishes == ["stop", "stop", "length"]
    for text in texts[:2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    return texts, tokens


@pytest.mark.parametrize("parallel", [ParallelConfig(tp=2), ParallelConfig(spp=2)],
                         ids=["tp2", "spp2"])
def test_guided_requests_with_workers_equal_the_single_process(tiny_model_dir, single_process,
                                                                parallel):
    engine = make_engine(tiny_model_dir, parallel)
    try:
        texts, tokens, finishes, mixed = run(engine)
        assert engine.block_manager.kv_blocks_used == 0
    finally:
        engine.close()
    assert mixed, "no step had a guided and a plain request at once"
    assert finishes == ["stop", "stop", "length"]
    for text in texts[:2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    expected_texts, expected_tokens = single_process
    assert texts[:2] == expected_texts[:2]
    # The plain request samples what it samples in the single process (and alone there).
    assert tokens == expected_tokens


def test_failed_masks_fail_only_the_guided_requests(tiny_model_dir, single_process,
                                                   monkeypatch):
    engine = make_engine(tiny_model_dir, ParallelConfig(tp=2))
    try:
        real_mask_job = engine.execution.mask_job

        def failing_mask_job(chunks):
            job = real_mask_job(chunks)
            if job is None:
                return None

            def masks():
                job()  # the helper thread is done with the matchers
                raise RuntimeError("a mask computation that fails, for the test")
            return masks

        monkeypatch.setattr(engine.execution, "mask_job", failing_mask_job)
        _, tokens, finishes, _ = run(engine)
        assert finishes == ["error", "error", "length"]
        assert tokens[2] == single_process[1][2]
        # The workers are still in step with the controller: grammars work again.
        monkeypatch.undo()
        texts, tokens, finishes, _ = run(engine)
        assert finishes == ["stop", "stop", "length"]
        assert texts[:2] == single_process[0][:2] and tokens == single_process[1]
    finally:
        engine.close()
