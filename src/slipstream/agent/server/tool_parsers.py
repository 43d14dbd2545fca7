"""The model families' tool-call syntaxes: a model's text into OpenAI calls, and a grammar
that only admits well-formed calls (for ``tool_choice`` "required" or a named function).

    hermes       Qwen 2/2.5/3, Hermes, and most ChatML models:
                 <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one per call
    llama3_json  Llama 3.1-3.3: {"name": ..., "parameters": {...}}, calls joined by "; ",
                 optionally after <|python_tag|>
    mistral      Mistral / Mixtral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

Each ``ToolParser`` reads whole outputs (``parse``, ``complete_calls``) and outputs so far
(``find_start``, ``holdback``, ``partial_calls``, which ``tool_stream`` turns into deltas).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from slipstream.agent.server.protocol import FunctionCall, ToolCall, ToolSpec
from slipstream.agent.server.tool_json import PartialCall, call_sequence, partial_call

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


def _suffix_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back while
    streaming: it may be the start of a call)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _after_marker(section: str, marker: str) -> str:
    """``section`` without its surrounding whitespace and a leading ``marker``."""
    text = section.strip()
    return text[len(marker):].lstrip() if text.startswith(marker) else text


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
        text = _after_marker(section, self.TAG)
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
        text = _after_marker(section, self.TAG)
        return call_sequence(text, ";", self.arguments_key)

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
        text = _after_marker(section, self.MARKER)
        try:
            obj, _ = json.JSONDecoder().raw_decode(text)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        texts: list[str | None] = [None] * len(items)
        if isinstance(obj, list):  # the item texts, for their arguments as written
            found = call_sequence(text[1:], ",", self.arguments_key, closer="]")
            if len(found) == len(items):
                texts = [text[1 + call.start:1 + call.end] for call in found]
        calls = [_call_from(item, self.arguments_key, item_text)
                 for item, item_text in zip(items, texts)]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]

    def partial_calls(self, section: str) -> list[PartialCall]:
        text = _after_marker(section, self.MARKER)
        if not text.startswith("["):
            return []
        return call_sequence(text[1:], ",", self.arguments_key, closer="]")

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

