"""Tool calling: the model's own call syntax in and out, OpenAI's ``tool_calls`` at the API.

    request tools -> the chat template (``tools``, as Hugging Face templates take them)
    model text -> ToolParser.parse -> ``tool_calls`` (arguments as a JSON string)
    tool_choice "required" or a named function -> ToolParser.grammar: an llguidance grammar
        that only admits well-formed calls of the allowed tools, so the call always parses

One parser per call syntax of the model families Slipstream loads (``--tool-call-parser``,
or picked from the chat template):

    hermes       Qwen 2/2.5/3, Hermes, and most ChatML models:
                 <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one per call
    llama3_json  Llama 3.1-3.3: {"name": ..., "parameters": {...}}, calls joined by "; ",
                 optionally after <|python_tag|>
    mistral      Mistral / Mixtral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

Streaming (``ToolStream``): text stays content until a call's opening appears. From there
each call goes out as OpenAI sends it: a first delta with the call's ``index``, ``id``,
``type`` and name (empty arguments) as soon as the name is complete, then its arguments as
the model writes them, a delta per step (the arguments' JSON text, which a scanner of
partial JSON tells apart from what follows it). Arguments written as a JSON string rather
than an object go out whole once complete. Text that looked like a call but never named a
function goes out as content at the end. Whole outputs (``parse``) give the same arguments
text, so a streamed call and a non-streamed one are alike.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from slipstream.agent.server.protocol import (
    ChatMessage, FunctionCall, NamedToolChoice, ToolCall, ToolSpec)

# Forced calls are compact JSON, like structured outputs (engine/grammar.py).
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def to_tool_call(self) -> ToolCall:
        return ToolCall(id=new_call_id(), function=FunctionCall(name=self.name,
                                                                arguments=self.arguments))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


ARGUMENT_KEYS = ("arguments", "parameters")


def _call_from(obj: Any, arguments_key: str, text: str | None = None) -> ParsedCall | None:
    """The call in a parsed JSON object; ``text`` is that object's JSON text, whose
    arguments object is then kept as written (as it was streamed)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if text is not None and isinstance(arguments, dict):
        partial = partial_call(text.strip(), 0, arguments_key)
        if partial is not None and partial.complete and partial.streams_arguments:
            return ParsedCall(obj["name"], partial.arguments)
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


# -- partial JSON: how much of a call the model has written so far ---------------------------

_WHITESPACE = " \t\r\n"


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in _WHITESPACE:
        position += 1
    return position


def json_value_end(text: str, position: int) -> int | None:
    """Where the JSON value that starts at ``text[position]`` ends (exclusive), or None if
    ``text`` ends first. Scans brackets and strings only; it does not validate."""
    first = text[position]
    if first == '"':
        index = position + 1
        while index < len(text):
            if text[index] == "\\":
                index += 2
                continue
            if text[index] == '"':
                return index + 1
            index += 1
        return None
    if first in "{[":
        depth, index, in_string = 0, position, False
        while index < len(text):
            char = text[index]
            if in_string:
                if char == "\\":
                    index += 1
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
            index += 1
        return None
    index = position  # a number, true, false or null: ends at a delimiter
    while index < len(text) and text[index] not in ",}]" + _WHITESPACE:
        index += 1
    return index if index < len(text) else None


@dataclass(frozen=True)
class PartialCall:
    """A call object as far as the model has written it."""

    name: str | None  # once its JSON string is complete
    arguments: str  # the arguments' JSON text so far (whole, once complete)
    streams_arguments: bool  # the arguments are an object, sent as written
    complete: bool  # the object is closed
    start: int  # where the object opens
    end: int  # where the scan stopped: after the closing brace when complete


def partial_call(text: str, position: int, arguments_key: str) -> PartialCall | None:
    """Scan the call object that starts at ``text[position]`` (after whitespace); None when
    it is not one (not an object, a key that is not a string, no colon)."""
    index = start = _skip_space(text, position)
    name: str | None = None
    arguments, streams, complete = "", False, False
    if index < len(text) and text[index] != "{":
        return None
    index += 1
    while True:
        index = _skip_space(text, index)
        if index >= len(text):
            break
        if text[index] == "}":
            complete, index = True, index + 1
            break
        if text[index] == ",":
            index += 1
            continue
        if text[index] != '"':
            return None
        key_end = json_value_end(text, index)
        if key_end is None:
            break
        key = json.loads(text[index:key_end])
        index = _skip_space(text, key_end)
        if index >= len(text):
            break
        if text[index] != ":":
            return None
        index = _skip_space(text, index + 1)
        if index >= len(text):
            break
        value_end = json_value_end(text, index)
        value = text[index:value_end] if value_end is not None else text[index:]
        if key == "name" and value_end is not None:
            decoded = json.loads(value)
            name = decoded if isinstance(decoded, str) else None
        elif key == arguments_key or (key in ARGUMENT_KEYS and not arguments):
            streams = value.startswith("{")
            if streams or value_end is not None:
                arguments = value
        if value_end is None:
            break
        index = value_end
    if not streams and arguments:
        # Arguments written as a JSON string (or another value): sent whole, as JSON, once
        # the call is complete.
        try:
            decoded = json.loads(arguments) if complete else None
            arguments = json.dumps(json.loads(decoded) if isinstance(decoded, str) else decoded,
                                   ensure_ascii=False) if complete else ""
        except ValueError:
            arguments = ""
    if complete and not arguments and not any(f'"{key}"' in text[start:index]
                                              for key in ARGUMENT_KEYS):
        arguments = "{}"  # a call without arguments, as parse() reads it
    return PartialCall(name, arguments, streams, complete, start, index)


def _call_sequence(text: str, separators: str, arguments_key: str,
                   closer: str = "") -> list[PartialCall]:
    """Call objects one after another, apart by ``separators`` and whitespace, up to the
    first incomplete one (or ``closer``)."""
    calls: list[PartialCall] = []
    position = 0
    while True:
        while position < len(text) and text[position] in separators + _WHITESPACE:
            position += 1
        if position >= len(text) or (closer and text[position] == closer):
            return calls
        call = partial_call(text, position, arguments_key)
        if call is None:
            return calls
        calls.append(call)
        if not call.complete:
            return calls
        position = call.end


def _suffix_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back while
    streaming: it may be the start of a call)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ToolParser:
    name = ""
    arguments_key = "arguments"

    def find_start(self, text: str) -> int | None:
        """Where the first call begins in ``text``, or None."""
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """How many trailing characters of content-so-far might still begin a call."""
        raise NotImplementedError

    def complete_calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        """The calls in ``section`` (the text from the first call's start) that are
        complete; ``final``: the output has ended. None: the section does not parse."""
        raise NotImplementedError

    def partial_calls(self, section: str) -> list[PartialCall]:
        """The calls begun in ``section`` so far, in order; only the last may be
        incomplete."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content before the calls or None, calls) of a whole output; no calls when the
        output has none or they do not parse (then it is all content)."""
        start = self.find_start(text)
        if start is None:
            return text, []
        calls = self.complete_calls(text[start:], final=True)
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def call_schema(self, tools: list[ToolSpec]) -> dict[str, Any]:
        """JSON schema of one call of any of ``tools`` in this syntax."""
        options = [{
            "type": "object",
            "properties": {"name": {"const": tool.function.name},
                           self.arguments_key: tool.function.parameters
                           or {"type": "object", "properties": {},
                               "additionalProperties": False}},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        } for tool in tools]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, **_COMPACT}

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        """Lark text (llguidance) for one call, or one or more when ``parallel``."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def find_start(self, text: str) -> int | None:
        index = text.find(self.OPEN)
        return None if index < 0 else index

    def holdback(self, text: str) -> int:
        return _suffix_prefix_len(text, self.OPEN)

    def complete_calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        bodies = self._CALL.findall(section)
        if final:
            tail = section[section.rfind(self.CLOSE) + len(self.CLOSE):] \
                if self.CLOSE in section else section
            if self.OPEN in tail:  # the output ended inside a call (EOS before the close)
                bodies.append(tail.split(self.OPEN, 1)[1].strip())
        calls = []
        for body in bodies:
            try:
                call = _call_from(json.loads(body), self.arguments_key, body)
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
        return calls

    def partial_calls(self, section: str) -> list[PartialCall]:
        calls = []
        for body in section.split(self.OPEN)[1:]:
            call = partial_call(body.split(self.CLOSE, 1)[0], 0, self.arguments_key)
            if call is None:
                break
            calls.append(call)
            if not call.complete:
                break
        return calls

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f'call: "{self.OPEN}\\n" body "\\n{self.CLOSE}"\n'
                f"body: %json {json.dumps(self.call_schema(tools))}\n")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"
    TAG = "<|python_tag|>"

    def find_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.TAG.startswith(stripped):
            return len(text)  # nothing decided yet: a call may still open the output
        return 0

    def complete_calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        if not final:
            return []
        text = section.strip()
        if text.startswith(self.TAG):
            text = text[len(self.TAG):].lstrip()
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(text):
            try:
                obj, end = decoder.raw_decode(text, position)
            except ValueError:
                return None
            call = _call_from(obj, self.arguments_key, text[position:end])
            if call is None:
                return None
            calls.append(call)
            position = end
            while position < len(text) and text[position] in " \n\t;":
                position += 1
        return calls

    def partial_calls(self, section: str) -> list[PartialCall]:
        text = section.strip()
        if text.startswith(self.TAG):
            text = text[len(self.TAG):]
        return _call_sequence(text, ";", self.arguments_key)

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        repeat = ' ("; " call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f"call: %json {json.dumps(self.call_schema(tools))}\n")


class MistralParser(ToolParser):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def find_start(self, text: str) -> int | None:
        index = text.find(self.MARKER)
        if index >= 0:
            return index
        stripped = text.lstrip()
        # The marker is a special token: decoding without special tokens drops it.
        return len(text) - len(stripped) if stripped.startswith("[{") else None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or "[{".startswith(stripped):
            return len(text)
        return _suffix_prefix_len(text, self.MARKER)

    def complete_calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        if not final:
            return []
        text = section.strip()
        if text.startswith(self.MARKER):
            text = text[len(self.MARKER):].lstrip()
        try:
            obj, _ = json.JSONDecoder().raw_decode(text)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        texts: list[str | None] = [None] * len(items)
        if isinstance(obj, list):  # the item texts, for their arguments as written
            found = _call_sequence(text[1:], ",", self.arguments_key, closer="]")
            if len(found) == len(items):
                texts = [text[1 + call.start:1 + call.end] for call in found]
        calls = [_call_from(item, self.arguments_key, item_text)
                 for item, item_text in zip(items, texts)]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]

    def partial_calls(self, section: str) -> list[PartialCall]:
        text = section.strip()
        if text.startswith(self.MARKER):
            text = text[len(self.MARKER):].lstrip()
        if not text.startswith("["):
            return []
        return _call_sequence(text[1:], ",", self.arguments_key, closer="]")

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        array = {"type": "array", "items": self.call_schema(tools), "minItems": 1,
                 **({} if parallel else {"maxItems": 1}), **_COMPACT}
        return f"start: %json {json.dumps(array)}\n"


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None) -> ToolParser:
    """The call syntax a chat template teaches its model (hermes when it says nothing)."""
    text = template or ""
    if "[TOOL_CALLS]" in text or "[AVAILABLE_TOOLS]" in text:
        return MistralParser()
    if "<tool_call>" in text:
        return HermesParser()
    if "<|start_header_id|>" in text or "<|python_tag|>" in text:
        return Llama3JsonParser()
    return HermesParser()


def resolve_parser(name: str, template: str | None) -> ToolParser:
    if name == "auto":
        return parser_for_template(template)
    return PARSERS[name]()


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


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of a call: its first (``name`` set, with ``id`` and ``type`` at
    the API) or more of its arguments' JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


class ToolStream:
    """One streamed choice's text, split into content deltas and call deltas."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls false: 1
        self.text = ""
        self.content_sent = 0
        self.start: int | None = None
        self.arguments_sent: list[int] = []  # per call begun: arguments characters sent

    @property
    def num_calls(self) -> int:
        return len(self.arguments_sent)

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        """Content to send now, and the call deltas since the last feed."""
        self.text += delta
        if self.start is None:
            start = self.parser.find_start(self.text[self.content_sent:])
            if start is not None:
                self.start = self.content_sent + start
        if self.start is None:
            end = len(self.text) if final else len(self.text) - self.parser.holdback(
                self.text[self.content_sent:])
            content, self.content_sent = self.text[self.content_sent:end], max(
                end, self.content_sent)
            return content, []
        content, self.content_sent = self.text[self.content_sent:self.start], self.start
        deltas: list[CallDelta] = []
        for index, call in enumerate(self.parser.partial_calls(self.text[self.start:])):
            if self.max_calls is not None and index >= self.max_calls:
                break
            if index == len(self.arguments_sent):  # not begun yet
                if call.name is None:
                    break
                self.arguments_sent.append(0)
                deltas.append(CallDelta(index, name=call.name))
            sent = self.arguments_sent[index]
            if len(call.arguments) > sent:
                deltas.append(CallDelta(index, arguments=call.arguments[sent:]))
                self.arguments_sent[index] = len(call.arguments)
            if not call.complete:
                break
        if final and not self.arguments_sent:  # it looked like a call but was content
            return content + self.text[self.start:], deltas
        return content, deltas
