"""A chat conversation (with its tools and tool turns) -> the prompt text the model reads.

A template that takes `tools` (Qwen's, Llama 3.1's, Mistral's) gets them, and the conversation
as HF's templates expect it: assistant `tool_calls` with their arguments as objects, `tool`
turns as they are. A template that does not (SmolLM2's, Gemma 3's) gets what its family's format
says instead (api/tool_formats.py): the tools' preamble in the system turn, the assistant's
calls written as the model would write them, each tool result as a user turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from halfmoon.api.tool_formats import ToolFormat
from halfmoon.api.tools import ToolRequest, tools_json
from halfmoon.engine.tokenizer import Tokenizer

Message = Mapping[str, Any]


def render(tokenizer: Tokenizer, messages: Sequence[Message], tools: ToolRequest | None,
           fmt: ToolFormat | None) -> str:
    """The prompt text of a conversation; `tools` None or tool_choice none: no tools offered."""
    offered = tools if tools is not None and tools.active else None
    if tokenizer.takes_tools or fmt is None or not (offered or _has_tool_turns(messages)):
        listed = tools_json(offered.tools) if offered is not None and tokenizer.takes_tools else None
        return tokenizer.apply_chat_template(list(messages), tools=listed)
    turns = _as_turns(messages, fmt)
    if offered is not None:
        turns = _with_preamble(turns, fmt.preamble(offered.tools))
    return tokenizer.apply_chat_template(turns)


def _has_tool_turns(messages: Sequence[Message]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _as_turns(messages: Sequence[Message], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Plain {role, content} turns; results of consecutive tool turns share one user turn (a
    template that wants roles to alternate, as Gemma's, takes parallel calls' results)."""
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        turn = _as_text(m, fmt)
        if m.get("role") == "tool" and i and messages[i - 1].get("role") == "tool":
            turns[-1] = {"role": "user", "content": turns[-1]["content"] + "\n" + turn["content"]}
        else:
            turns.append(turn)
    return turns


def _as_text(message: Message, fmt: ToolFormat) -> dict[str, Any]:
    """A turn as plain {role, content}: calls and results in the format's text."""
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": fmt.result_text(content)}
    calls = message.get("tool_calls")
    if calls:
        text = fmt.call_text(calls)
        return {"role": role, "content": f"{content}\n{text}" if content else text}
    return {"role": role, "content": content}


def _with_preamble(turns: list[dict[str, Any]], preamble: str) -> list[dict[str, Any]]:
    """The tools' preamble after the system turn's own text (a system turn first if none)."""
    if turns and turns[0]["role"] == "system":
        first = turns[0]["content"]
        return [{"role": "system", "content": f"{first}\n\n{preamble}" if first else preamble}, *turns[1:]]
    return [{"role": "system", "content": preamble}, *turns]
