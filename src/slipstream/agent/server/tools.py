"""Tool calling: the model's own call syntax in and out, OpenAI's ``tool_calls`` at the API.

    request tools -> the chat template (``tools``, as Hugging Face templates take them) and
        the messages' earlier calls and results (``template_messages``, here)
    model text -> ToolParser.parse -> ``tool_calls`` (arguments as a JSON string)
    tool_choice "required" or a named function -> ``forced_tools`` (here) ->
        ToolParser.grammar: an llguidance grammar that only admits well-formed calls of the
        allowed tools, so the call always parses

The pieces:

    tools.py         the request side: messages for the template, the tools a choice forces
    tool_parsers.py  one ToolParser per call syntax (hermes, llama3_json, mistral; chosen
                     by ``--tool-call-parser`` or from the chat template)
    tool_stream.py   ToolStream: a streamed output into content and call deltas
    tool_json.py     the partial-JSON scanner both of those read calls with
"""

from __future__ import annotations

import json
from typing import Any

from slipstream.agent.server.protocol import ChatMessage, NamedToolChoice, ToolSpec


def forced_tools(tools: list[ToolSpec], choice: str | NamedToolChoice) -> list[ToolSpec] | None:
    """The tools a grammar must restrict the output to: all for ``required``, one for a
    named function, None when the model may answer freely."""
    if isinstance(choice, NamedToolChoice):
        return [tool for tool in tools if tool.function.name == choice.function.name]
    return tools if choice == "required" else None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates read them: an assistant turn's tool calls with
    their arguments as objects (templates write them with ``tojson``), a tool turn with the
    id of the call it answers."""
    result = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [{
                "id": call.id, "type": "function",
                "function": {"name": call.function.name,
                             "arguments": _arguments_object(call.function.arguments)},
            } for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments

