"""Grammar-constrained decoding in the engine, on the random tiny model: its weights are
random, so only the grammar can make an output valid.

The property test draws random JSON schemas and checks that every output parses and
validates against its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.sampling.grammar import json_schema_grammar, lark_grammar
from slipstream.contracts.sampling import SamplingParams

PROMPT = [11, 222, 333, 44]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=256))


def run(engine, params_list, prompt=PROMPT):
    ids = [engine.add_request(prompt, params) for params in params_list]
    text = {rid: "" for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finish = {}
    batch_mix = set()
    while engine.has_unfinished():
        guided_before = {rid for rid in ids if rid in engine._outputs
                         and engine._outputs[rid].matcher is not None}
        plain_before = {rid for rid in ids if rid in engine._outputs} - guided_before
        for out in engine.step():
            text[out.request_id] += out.new_text
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        if guided_before and plain_before:
            batch_mix.add(True)
    assert engine.block_manager.kv_blocks_used == 0
    return [text[r] for r in ids], [tokens[r] for r in ids], [finish[r] for r in ids], batch_mix


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def test_guided_and_plain_requests_share_batches_without_touching_each_other(engine):
    grammar = json_schema_grammar(PERSON)
    plain = [SamplingParams(max_tokens=20, temperature=1.0, seed=50 + i, ignore_eos=True)
             for i in range(2)]
    guided = [SamplingParams(max_tokens=300, temperature=1.0, seed=i, grammar=grammar)
              for i in range(2)]
    texts, tokens, finishes, mixed = run(engine, guided + plain)
    assert mixed, "no step ran guided and plain requests together"
    for text, finish in zip(texts[:2], finishes[:2]):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    # A plain request samples exactly what it samples alone: the masks stay on their rows.
    _, alone, _, _ = run(engine, plain)
    assert tokens[2:] == alone


def test_a_greedy_request_under_a_grammar_is_repeatable(engine):
    grammar = json_schema_grammar(PERSON["properties"]["address"])
    first, _, _, _ = run(engine, [SamplingParams(max_tokens=300, temperature=0.0,
                                                 grammar=grammar)])
    second, _, _, _ = run(engine, [SamplingParams(max_tokens=300, temperature=0.0,
                                                  grammar=grammar)])
    assert first == second
    jsonschema.validate(json.loads(first[0]), PERSON["properties"]["address"])


def test_lark_grammar_and_length_cut(engine):
    grammar = lark_grammar('start: "yes" | "no"')
    texts, _, finishes, _ = run(engine, [SamplingParams(max_tokens=10, temperature=1.0,
                                                        seed=s, grammar=grammar)
                                         for s in range(4)])
    assert set(texts) <= {"yes", "no"} and finishes == ["stop"] * 4
    # max_tokens still wins: the grammar never extends a request.
    long_grammar = json_schema_grammar({"type": "array", "items": {"type": "integer"},
                                        "minItems": 50})
    texts, _, finishes, _ = run(engine, [SamplingParams(max_tokens=5, temperature=1.0, seed=1,
                                                        grammar=long_grammar)])
    assert finishes == ["length"] and texts[0].startswith("[")


def test_unsupported_schema_features_are_named(engine):
    error = engine.grammar.check(json_schema_grammar(
        {"type": "object", "if": {"properties": {"a": {"const": 1}}}}))
    assert error is not None and "if" in error
    assert engine.grammar.check(json_schema_grammar(PERSON)) is None


# ---- property test: random schemas --------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "id", "name", "kind", "items", "x_1", "value"])


def _leaf() -> st.SearchStrategy[dict]:
    bounded_int = st.tuples(st.integers(-1000, 1000), st.integers(0, 500)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    string = st.tuples(st.integers(0, 3), st.integers(0, 10)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]})
    enum = st.lists(st.one_of(st.sampled_from(["red", "green", "blue", "a b", "\u00e9t\u00e9"]),
                              st.integers(-5, 5), st.booleans(), st.none()),
                    min_size=1, max_size=4, unique_by=lambda v: (type(v), v)).map(
        lambda values: {"enum": values})
    return st.one_of(st.just({"type": "boolean"}), st.just({"type": "null"}), bounded_int,
                     string, enum, st.integers(0, 9).map(lambda v: {"const": v}),
                     st.just({"type": "number", "minimum": -10, "maximum": 10}))


def _extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def make_object(props: dict[str, dict], required_flags: list[bool]) -> dict:
        names = sorted(props)
        required = [n for n, flag in zip(names, required_flags) if flag]
        return {"type": "object", "properties": props, "required": required,
                "additionalProperties": False}

    obj = st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
            lambda flags: make_object(props, flags)))
    array = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    any_of = st.lists(children, min_size=2, max_size=3).map(lambda opts: {"anyOf": opts})
    return st.one_of(obj, array, any_of)


SCHEMAS = st.recursive(_leaf(), _extend, max_leaves=6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_every_output_of_a_random_schema_validates(engine, schema, seed):
    grammar = json_schema_grammar(schema)
    assert engine.grammar.check(grammar) is None, schema
    texts, _, finishes, _ = run(engine, [SamplingParams(max_tokens=600, temperature=1.0,
                                                        seed=seed, grammar=grammar)])
    assert finishes == ["stop"], (schema, texts)
    jsonschema.validate(json.loads(texts[0]), schema)


# ---- forced tool calls: the grammar of each call syntax makes the random model's output
# parse into calls of the allowed tools, with arguments valid under their schemas ----------

def _tools():
    from slipstream.agent.server.protocol import ToolSpec

    weather = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}
    clock = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 4}},
             "required": ["tz"], "additionalProperties": False}
    return [ToolSpec.model_validate({"type": "function", "function": {
                "name": "get_weather", "parameters": weather}}),
            ToolSpec.model_validate({"type": "function", "function": {
                "name": "get_time", "parameters": clock}})]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_always_parse(engine, family, parallel):
    from slipstream.agent.server.tool_parsers import PARSERS

    parser = PARSERS[family]()
    tools = _tools()
    grammar = lark_grammar(parser.grammar(tools, parallel))
    assert engine.grammar.check(grammar) is None
    texts, _, finishes, _ = run(engine, [SamplingParams(max_tokens=300, temperature=1.0,
                                                        seed=seed, grammar=grammar)
                                         for seed in range(2)])
    schemas = {tool.function.name: tool.function.parameters for tool in tools}
    for text, finish in zip(texts, finishes):
        assert finish == "stop", text
        content, calls = parser.parse(text)
        assert content is None and calls, text
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_mask_jobs_give_each_row_its_own_mask_whoever_fills_it(engine):
    """The sampler's side of a ``MaskJob`` fills what the helper thread has not reached:
    with the helper held up, the sampler fills every row; either way each row holds exactly
    its matcher's mask (checked against llguidance's own call), and a job's buffer is not
    the one the previous job handed out."""
    import threading

    import llguidance.torch
    import torch

    from slipstream.agent.engine.sampling.grammar import MaskWorkers

    grammar = json_schema_grammar(PERSON)
    matchers = [engine.grammar.matcher(grammar) for _ in range(5)]
    for matcher, prefix in zip(matchers, ['{"name":"a', '{"name":"', '{', '', '{"name":"bc"']):
        assert matcher.consume_tokens(engine.tokenizer.encode(prefix, add_special_tokens=False))
    vocab = engine.grammar.lltokenizer.vocab_size
    expected = llguidance.torch.allocate_token_bitmask(len(matchers), vocab)
    for index, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, expected, index)
    assert len({tuple(row.tolist()) for row in expected}) > 1  # the rows differ

    workers = MaskWorkers(vocab)
    rows = [(2 * index + 1, matcher) for index, matcher in enumerate(matchers)]
    free = workers.start(rows)().allowed.clone()
    release = threading.Event()
    blocker = type("Blocker", (), {"help": lambda self: release.wait(60)})()
    workers._jobs.put(blocker)  # the helper thread is busy: this step's rows are the sampler's
    job = workers.start(rows)
    masks = job()
    release.set()
    assert masks.rows == [row for row, _ in rows] and masks.dead_rows == []
    assert torch.equal(free, expected) and torch.equal(masks.allowed, expected)
    assert masks.allowed.data_ptr() != workers.start(rows)().allowed.data_ptr()
    workers.close()
