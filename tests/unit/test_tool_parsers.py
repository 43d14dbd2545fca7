"""Tool-call syntax of each supported family: whole outputs, streamed pieces, the chat
template's view of tools and calls, and the request checks."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from slipstream.agent.engine.tokenizer import compile_chat_template
from slipstream.agent.server.protocol import ChatCompletionRequest, ChatMessage, ToolSpec
from slipstream.agent.server.tool_json import json_value_end, partial_call
from slipstream.agent.server.tool_parsers import (
    HermesParser, Llama3JsonParser, MistralParser, ParsedCall, parser_for_template)
from slipstream.agent.server.tool_stream import CallDelta, ToolStream
from slipstream.agent.server.tools import template_messages

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "days": 2}')
TIME = ParsedCall("get_time", '{"tz": "UTC"}')

OUTPUTS = {
    "hermes": (HermesParser(),
               'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {"tz": "UTC"}}\n</tool_call>', "Let me check."),
    "llama3_json": (Llama3JsonParser(),
                    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": 2}}; {"name": "get_time", "parameters": {"tz": "UTC"}}', None),
    "mistral": (MistralParser(),
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 2}}, {"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}]', None),
}


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_whole_outputs_parse_into_calls(family):
    parser, text, content = OUTPUTS[family]
    parsed_content, calls = parser.parse(text)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c.name, json.loads(c.arguments)) for c in (WEATHER, TIME)]
    assert calls[0].arguments == '{"city": "Paris", "days": 2}'  # as the model wrote it


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_plain_text_and_broken_calls_stay_content(family):
    parser = OUTPUTS[family][0]
    assert parser.parse("The weather is fine.") == ("The weather is fine.", [])
    broken = {"hermes": "<tool_call>{not json</tool_call>", "llama3_json": "{not json",
              "mistral": "[TOOL_CALLS][{oops"}[family]
    assert parser.parse(broken) == (broken, [])


@pytest.mark.parametrize("family", sorted(OUTPUTS))
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_pieces_give_the_same_content_and_calls(family, piece):
    parser, text, content = OUTPUTS[family]
    stream = ToolStream(parser)
    streamed_content, calls = "", collect_calls([])
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    deltas = []
    for number, part in enumerate(pieces):
        new_content, new_deltas = stream.feed(part, final=number == len(pieces) - 1)
        streamed_content += new_content
        deltas.extend(new_deltas)
    assert streamed_content.strip() == (content or "")
    # The concatenated deltas are exactly the calls of the whole output.
    assert collect_calls(deltas) == parser.parse(text)[1]
    if piece < 1000:  # arguments came in several deltas, not one per call
        assert sum(1 for d in deltas if d.name is None) > 2


def collect_calls(deltas) -> list[ParsedCall]:
    """What a client makes of OpenAI's streamed call deltas."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        if delta.name is not None:
            assert delta.index == len(names) and not delta.arguments  # in order, name first
            names[delta.index], arguments[delta.index] = delta.name, ""
        else:
            arguments[delta.index] += delta.arguments
    return [ParsedCall(names[i], arguments[i]) for i in sorted(names)]


def test_streamed_plain_text_is_not_held_forever():
    stream = ToolStream(HermesParser())
    assert stream.feed("Hello <tool", final=False) == ("Hello ", [])  # may open a call
    assert stream.feed("box> there", final=False) == ("<toolbox> there", [])
    assert stream.feed("", final=True) == ("", [])
    llama = ToolStream(Llama3JsonParser())
    assert llama.feed("  ", final=False) == ("", [])  # a call may still open the output
    assert llama.feed("Sure, {x}", final=False) == ("  Sure, {x}", [])


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_arguments_stream_as_the_model_writes_them(family):
    parser, text, _ = OUTPUTS[family]
    stream = ToolStream(parser)
    name_end = text.index('"get_weather"') + len('"get_weather"')
    _, deltas = stream.feed(text[:name_end - 1], final=False)
    assert deltas == []  # the name is not complete yet
    _, deltas = stream.feed(text[name_end - 1:name_end], final=False)
    assert deltas == [CallDelta(0, name="get_weather")]  # the call begins at once
    middle = text.index('"Paris"') + 3
    _, deltas = stream.feed(text[name_end:middle], final=False)
    assert deltas == [CallDelta(0, arguments='{"city": "Pa')]  # mid-string, mid-call
    _, deltas = stream.feed(text[middle:], final=True)
    assert collect_calls([CallDelta(0, name="get_weather"),
                          CallDelta(0, arguments='{"city": "Pa'), *deltas]) == [WEATHER, TIME]


def test_only_the_first_call_streams_without_parallel_calls():
    parser, text, _ = OUTPUTS["hermes"]
    stream = ToolStream(parser, max_calls=1)
    _, deltas = stream.feed(text, final=True)
    assert collect_calls(deltas) == [WEATHER] and stream.num_calls == 1


def test_partial_json_scanner_finds_value_ends():
    text = '{"a": "x}\\"y", "b": [1, {"c": "]"}], "d": 12, "e": true}'
    assert json_value_end(text, 0) == len(text)
    assert json_value_end(text, text.index('"x')) == text.index(', "b"')
    assert json_value_end(text, text.index("[1")) == text.index(', "d"')
    assert json_value_end(text, text.index("12")) == text.index(', "e"')
    for cut in range(1, len(text)):
        assert json_value_end(text[:cut], 0) is None
    call = partial_call('{"arguments": {"q": "a', 0, "arguments")
    assert call is not None and call.name is None and call.arguments == '{"q": "a'
    assert partial_call('["not", "a call"]', 0, "arguments") is None


def test_parser_is_picked_from_the_chat_template():
    assert parser_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for_template("[AVAILABLE_TOOLS] [TOOL_CALLS]").name == "mistral"
    assert parser_for_template("<|start_header_id|>").name == "llama3_json"
    assert parser_for_template(None).name == "hermes"


# A Qwen-2.5-style template, written for this test: it renders the tools, an assistant's
# calls (arguments with tojson, so they must be objects) and tool results.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_template_receives_tools_calls_and_results_as_hugging_face_templates_expect():
    request = ChatCompletionRequest.model_validate({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})
    rendered = compile_chat_template(HERMES_TEMPLATE).render(
        messages=template_messages(request.messages), add_generation_prompt=True,
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools])
    assert '{"type": "function", "function": {"name": "get_weather"' in rendered
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert '<tool_response id="call_1">\nsunny' in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [_tool("a")], "tool_choice": {"type": "function", "function": {"name": "b"}}},
     "not in tools"),
    ({"tools": [_tool("a"), _tool("a")]}, "distinct"),
    ({"tools": [_tool("bad name!")]}, "pattern"),
])
def test_tool_requests_are_checked(fields, words):
    with pytest.raises(ValidationError, match=words):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], **fields})


def test_default_tool_choice_follows_openai():
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(base).effective_tool_choice == "none"
    with_tools = ChatCompletionRequest.model_validate({**base, "tools": [_tool("a")]})
    assert with_tools.effective_tool_choice == "auto"
    assert isinstance(with_tools.tools[0], ToolSpec)
    assert ChatMessage.model_validate({"role": "tool", "tool_call_id": "c", "content": "r"}
                                      ).tool_call_id == "c"
