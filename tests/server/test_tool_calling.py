"""Tool calling through real HTTP with the official ``openai`` client: a full round trip
(forced call, tool result, final answer), streamed and not streamed. The tiny model's chat
template is Llama-3 style, so the server parses llama3_json calls; the random weights only
produce a call because the grammar of ``tool_choice`` makes them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.timeout(600)

WEATHER_PARAMS = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 8},
                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {
            "type": "object", "properties": {"tz": {"type": "string", "maxLength": 4}},
            "required": ["tz"], "additionalProperties": False}}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _final_answer(client, model, messages, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                          tool_choice="none", max_tokens=8, **kwargs)


def test_round_trip_not_streamed(layout_server):
    server = layout_server
    client = server.openai_client(timeout=300)
    first = client.chat.completions.create(model=server.model, messages=QUESTION, tools=TOOLS,
                                           tool_choice=NAMED, max_tokens=200, seed=3)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    final = _final_answer(client, server.model, messages)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")
    # The tool turn reached the prompt: it is longer than the question alone.
    alone = _final_answer(client, server.model, QUESTION)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens


def test_round_trip_streamed(layout_server):
    server = layout_server
    client = server.openai_client(timeout=300)
    stream = client.chat.completions.create(model=server.model, messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=200, seed=5, stream=True)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                if delta.id:
                    assert entry["id"] is None  # the id comes once, in the call's first delta
                    entry["id"] = delta.id
                if delta.function and delta.function.name:
                    entry["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    entry["arguments"] += delta.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0]
    call = calls[0]
    assert call["name"] in ("get_weather", "get_time") and call["id"].startswith("call_")
    arguments = json.loads(call["arguments"])
    if call["name"] == "get_weather":
        jsonschema.validate(arguments, WEATHER_PARAMS)
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in _final_answer(
        client, server.model, messages, stream=True) if chunk.choices)
    assert text


def test_auto_leaves_plain_answers_as_content(layout_server):
    server = layout_server
    result = server.openai_client(timeout=300).chat.completions.create(
        model=server.model, messages=QUESTION, tools=TOOLS, max_tokens=6, temperature=0)
    choice = result.choices[0]
    # Greedy text of the random model is not a call: it stays content.
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400s(server):
    def post(**fields):
        return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": server.model, "messages": QUESTION, **fields})

    response = post(tool_choice={"type": "function", "function": {"name": "nope"}},
                    tools=TOOLS)
    assert response.status_code == 400 and "not in tools" in response.json()["error"]["message"]
    response = post(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "if": {}}}}], tool_choice="required")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools" and '"if"' in \
        response.json()["error"]["message"]
    response = post(tools=TOOLS, tool_choice="required",
                    response_format={"type": "json_object"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format"


# A Qwen-2.5-style template (written for this test) on the tiny model's weights: the tools
# reach the prompt, the server picks the hermes syntax from the template, and a forced call
# comes back parsed.
HERMES_TEMPLATE = """{{- bos_token }}
{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call, return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def hermes_server(tiny_model_dir, tmp_path_factory, serve_model):
    import shutil

    model_dir = tmp_path_factory.mktemp("hermes") / "tiny-hermes"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with serve_model(model_dir, tmp_path_factory.mktemp("hermes-server")) as handle:
        yield handle


def test_hermes_template_gets_the_tools_and_calls_parse(hermes_server):
    client = hermes_server.openai_client(timeout=300)
    without = client.chat.completions.create(model=hermes_server.model, messages=QUESTION,
                                             max_tokens=1)
    with_tools = client.chat.completions.create(model=hermes_server.model, messages=QUESTION,
                                                tools=TOOLS, tool_choice="none", max_tokens=1)
    # The tool list (names, descriptions, schemas) was rendered into the prompt.
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50
    result = client.chat.completions.create(model=hermes_server.model, messages=QUESTION,
                                            tools=TOOLS, tool_choice="required",
                                            max_tokens=300, seed=9)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
