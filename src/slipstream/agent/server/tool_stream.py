"""Streaming tool calls: one choice's text, as it arrives, into content deltas and call deltas.

Text stays content until a call's opening appears. From there each call goes out as OpenAI
sends it: a first delta with the call's ``index``, ``id``, ``type`` and name (empty
arguments) as soon as the name is complete, then its arguments as the model writes them, a
delta per step (the arguments' JSON text, which a scanner of partial JSON tells apart from
what follows it). Arguments written as a JSON string rather than an object go out whole once
complete. Text that looked like a call but never named a function goes out as content at the
end. Whole outputs (``parse``) give the same arguments text, so a streamed call and a
non-streamed one are alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.agent.server.tool_parsers import ToolParser


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
