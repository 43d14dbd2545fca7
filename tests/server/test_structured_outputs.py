"""``response_format`` through real HTTP with the official ``openai`` client, including
``client.beta.chat.completions.parse`` with pydantic models. The tiny model's weights are
random: every valid answer here is the grammar's doing."""

from __future__ import annotations

import enum
import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(600)

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    city: str = Field(max_length=10)
    zip_code: int = Field(ge=10000, le=99999)


class Person(BaseModel):  # nested object, enum, array, optional field
    name: str = Field(max_length=12)
    favourite: Color
    address: Address
    scores: list[int] = Field(max_length=3)
    nickname: str | None = Field(max_length=6)


class Inventory(BaseModel):  # array of objects, optional nested object
    items: list[Address] = Field(max_length=2)
    owner: Person | None


class Flags(BaseModel):  # booleans, bounded numbers, enum arrays
    enabled: bool
    ratio: float = Field(ge=0, le=1)
    colors: list[Color] = Field(max_length=4)


@pytest.mark.parametrize("model", [Person, Inventory, Flags])
def test_parse_returns_the_pydantic_model(layout_server, model):
    server = layout_server
    completion = server.openai_client(timeout=300).beta.chat.completions.parse(
        model=server.model, messages=MESSAGES, response_format=model, max_tokens=600,
        temperature=1.0, seed=4)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    assert model.model_validate_json(choice.message.content) == choice.message.parsed


def test_streamed_json_schema_output_parses(layout_server):
    server = layout_server
    schema = {"type": "object",
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    stream = server.openai_client(timeout=300).chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=1,
        stream=True, response_format={"type": "json_schema",
                                      "json_schema": {"name": "s", "schema": schema,
                                                      "strict": True}})
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object_with_n_choices(layout_server):
    server = layout_server
    result = server.openai_client(timeout=300).chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=400, temperature=1.0, n=2,
        response_format={"type": "json_object"})
    for choice in result.choices:
        if choice.finish_reason == "stop":  # an open object may run to max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


def test_unsupported_schema_keyword_is_a_400_naming_it(layout_server):
    server = layout_server
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "if": {"properties": {"a": {"const": 1}}}}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": MESSAGES,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "cond", "schema": schema}}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert '"if"' in error["message"]
    missing = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": MESSAGES,
        "response_format": {"type": "json_schema"}})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "response_format"


def test_guided_and_plain_requests_run_together(layout_server):
    """Structured and plain requests in flight at once: each guided answer parses, and each
    plain greedy answer is exactly what it is alone (a grammar's mask touches only its row)."""
    import asyncio

    server = layout_server
    plain_messages = [{"role": "user", "content": "Tell me a story."}]
    alone = server.openai_client(timeout=300).chat.completions.create(
        model=server.model, messages=plain_messages, max_tokens=40, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].message.content

    async def together():
        client = server.async_openai_client(timeout=300)
        guided = [client.beta.chat.completions.parse(
            model=server.model, messages=MESSAGES, response_format=Flags, max_tokens=300,
            temperature=1.0, seed=seed) for seed in range(3)]
        plain = [client.chat.completions.create(
            model=server.model, messages=plain_messages, max_tokens=40, temperature=0,
            extra_body={"ignore_eos": True}) for _ in range(3)]
        return await asyncio.gather(*guided, *plain)

    results = asyncio.run(together())
    for result in results[:3]:
        assert result.choices[0].finish_reason == "stop"
        assert isinstance(result.choices[0].message.parsed, Flags)
    assert [result.choices[0].message.content for result in results[3:]] == [alone] * 3


WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_grammars_with_tensor_parallel_workers_equal_one_process(server, start_server):
    """``--tp 2``: the grammar masks go from the engine to the sampling worker each step.
    A parsed answer and a forced tool call, seeded, are exactly the one-process server's."""
    parallel = start_server("--tp", "2")
    answers = []
    for handle in (server, parallel):
        client = handle.openai_client(timeout=300)
        parsed = client.beta.chat.completions.parse(
            model=handle.model, messages=MESSAGES, response_format=Person, max_tokens=600,
            temperature=1.0, seed=4).choices[0]
        assert parsed.finish_reason == "stop" and isinstance(parsed.message.parsed, Person)
        called = client.chat.completions.create(
            model=handle.model, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER], tool_choice={"type": "function",
                                          "function": {"name": "get_weather"}},
            max_tokens=200, seed=3).choices[0]
        assert called.finish_reason == "tool_calls"
        [call] = called.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
        answers.append((parsed.message.content, call.function.arguments))
    assert answers[0] == answers[1]
