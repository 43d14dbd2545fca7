"""Partial JSON scanning for tool calls: how much of a call object the model has written so
far, without waiting for the JSON to close.

    text of a call so far --partial_call()--> PartialCall(name once complete, arguments so far)
    "call; call; ..." or "call, call, ..." --call_sequence()--> the calls begun, in order

The scanner tracks brackets and strings only; it does not validate. The parsers
(``tool_parsers``) use it to stream arguments as written and to keep a whole output's
arguments text the same as the streamed one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# The keys a call object may hold its arguments under (llama3_json writes "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")

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


def call_sequence(text: str, separators: str, arguments_key: str,
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

