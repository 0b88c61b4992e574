"""Tool calls in a stream: one choice's text deltas -> OpenAI's chat deltas.

Text that surely is content goes out as it comes (trailing whitespace once more text follows it); from where a call may begin (the format's
marker, or an answer that starts like calls) it is held back, and each call is sent once it is
whole, as OpenAI sends calls: a delta with its index, id, type and name, then one with its
arguments. Held-back text that turns out to be no call is sent as content at the end: nothing
the model wrote is lost.
"""

from __future__ import annotations

from typing import Any

from halfmoon.api.tool_formats import ToolFormat
from halfmoon.api.tools import ToolCall

Delta = dict[str, Any]


class ToolStream:
    """One choice's text, split into content and tool calls as it streams."""

    __slots__ = ("fmt", "held", "sent_content", "in_calls", "calls")

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.held = ""  # received, not yet sent
        self.sent_content = False
        self.in_calls = False
        self.calls: list[ToolCall] = []  # sent

    def push(self, text: str) -> list[Delta]:
        """The deltas `text` makes sendable."""
        self.held += text
        if self.in_calls:
            return self._new_calls(self.fmt.parse(self.held).calls)
        safe, started = self.fmt.split(self.held, at_start=not self.sent_content)
        out = self._content(len(self.held[:safe].rstrip()))  # whitespace before a call is not content
        if started:
            self.in_calls = True
            out += self._new_calls(self.fmt.parse(self.held).calls)
        return out

    def finish(self) -> list[Delta]:
        """The last deltas: calls not yet sent, or what was held back as content."""
        if not self.in_calls:
            return self._content(len(self.held))
        parsed = self.fmt.parse(self.held)
        if parsed.calls and len(parsed.calls) >= len(self.calls):
            return self._new_calls(parsed.calls)
        if self.calls:  # calls were sent, then the rest failed to parse: the rest is content
            rest, self.held = self.held, ""
            return [{"content": rest}] if rest.strip() else []
        return self._content(len(self.held))

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _content(self, n: int) -> list[Delta]:
        if n <= 0:
            return []
        text, self.held = self.held[:n], self.held[n:]
        self.sent_content = True
        return [{"content": text}]

    def _new_calls(self, parsed: tuple[ToolCall, ...]) -> list[Delta]:
        out: list[Delta] = []
        for call in parsed[len(self.calls):]:
            index = len(self.calls)
            self.calls.append(call)
            out.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return out
