"""Schemathesis hooks (loaded through SCHEMATHESIS_HOOKS by tests/fuzz/test_http_fuzz.py): the
two rules of the chat API a JSON Schema cannot state.

- A named `tool_choice` must name one of the request's `tools` (400 otherwise, as OpenAI
  answers): `map_body` makes a generated named choice name the first tool.
- A prompt's length in tokens: the conversation and its tools, templated, must fit the server's
  prompt limit. Every character of JSON text (ASCII-escaped) is at most one byte-level token per
  byte it spells, so `filter_body` drops conversations whose JSON is over PROMPT_CHARS.

The server's refusal of both is tested where it is a feature (tests/conductor/test_tools_api.py,
test_http_api.py).

And one rule of the admin API: a LoRA adapter's `lora_path` must be a PEFT folder the base model
can serve (400 naming the reason otherwise). `map_body` makes a generated non-empty path the
fixture's adapter (HALFMOON_FUZZ_ADAPTER), so valid loads are served; a refused path is
tests/conductor/test_lora_api.py's.
"""

from __future__ import annotations

from typing import Any

import json
import os

import schemathesis

from tests.fuzz.conftest import LIMITS

PROMPT_CHARS = LIMITS.max_prompt_tokens // 2  # the rest: the template's and the tools' preamble's tokens


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    if not isinstance(body, dict) or not ({"messages", "tools"} & set(body)):
        return True
    text = json.dumps([body.get("messages"), body.get("tools")], ensure_ascii=True)
    return len(text) <= PROMPT_CHARS


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    path = body.get("lora_path")
    if isinstance(path, str) and path and os.environ.get("HALFMOON_FUZZ_ADAPTER"):
        body["lora_path"] = os.environ["HALFMOON_FUZZ_ADAPTER"]
    choice, tools = body.get("tool_choice"), body.get("tools")
    if not (isinstance(choice, dict) and isinstance(choice.get("function"), dict) and "name" in choice["function"]):
        return body
    first = tools[0] if isinstance(tools, list) and tools and isinstance(tools[0], dict) else None
    function = first.get("function") if first is not None else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        choice["function"]["name"] = function["name"]
    return body
