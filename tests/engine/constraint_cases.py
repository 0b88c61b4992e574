"""Held-out-style constraints the tests sample under: JSON schemas with enums, bounded strings and
integers, nested objects, arrays with maxItems and a `pattern`; regexes; choices; a tool call
(tool_choice required's grammar in the Hermes format, the arguments held to each function's
parameters). Shared by the engine, 1P1D and API tests and by `halfmoon bench constraints`' test
schemas."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from halfmoon.api.tool_formats import FORMATS
from halfmoon.api.tools import from_openai
from halfmoon.core.params import Constraint, ConstraintKind

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
               "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "role": {"enum": ["admin", "user", "guest"]}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["id", "items", "ship"],
              "properties": {
                  "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                  "items": {"type": "array", "minItems": 1, "maxItems": 3,
                            "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                      "properties": {"sku": {"type": "string", "maxLength": 12},
                                                     "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
                  "ship": {"type": "object", "additionalProperties": False, "required": ["city", "express"],
                           "properties": {"city": {"type": "string", "maxLength": 20},
                                          "express": {"type": "boolean"}}}}},
    "event": {"type": "object", "additionalProperties": False, "required": ["title", "score", "tags"],
              "properties": {"title": {"type": "string", "maxLength": 24},
                             "score": {"type": "number", "minimum": 0, "maximum": 10},
                             "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
                             "note": {"type": "string", "maxLength": 10}}},
}
REGEXES = {"phone": r"\(\d{3}\) \d{3}-\d{4}", "color": r"(red|green|blue) [a-z]{2,8}"}
CHOICES = ["positive", "negative", "neutral"]
PROMPTS = {"person": "Describe a person as JSON with name, age and role.",
           "order": "Write a JSON order: an id, some items and where to ship it.",
           "event": "Describe an event as JSON with a title, a score and tags.",
           "phone": "What is the phone number?", "color": "Name a color and an animal.",
           "choice": "Is this review positive or negative? 'I loved it.'",
           "tool_call": "What is the weather in Paris, or the time in Tokyo?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "required": ["city"], "properties": {
                  "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]},
                  "days": {"type": "integer", "minimum": 1, "maximum": 5}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
              "type": "object", "required": ["zone"], "properties": {
                  "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}/[A-Z][a-z]{2,10}$"}}}}}]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def tool_constraint() -> Constraint:
    """tool_choice required, one call, in the Hermes format (what the front door builds)."""
    tools = from_openai({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert tools is not None
    return Constraint(ConstraintKind.GRAMMAR, FORMATS["hermes"].grammar(tools))


def schema_constraint(name: str) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS[name]))


def all_cases() -> list[tuple[str, Constraint]]:
    """(name, constraint) of every case: each schema, each regex, the choice."""
    return [*((n, schema_constraint(n)) for n in SCHEMAS),
            *((n, Constraint(ConstraintKind.REGEX, r)) for n, r in REGEXES.items()),
            ("choice", Constraint(ConstraintKind.CHOICE, json.dumps(CHOICES))), ("tool_call", tool_constraint())]


def check(name: str, text: str) -> None:
    """Raise unless `text` satisfies case `name` (jsonschema for the schemas, fullmatch for the
    regexes, membership for the choice)."""
    if name in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    elif name in REGEXES:
        assert re.fullmatch(REGEXES[name], text), (name, text)
    elif name == "tool_call":
        calls = FORMATS["hermes"].parse(text).calls
        assert len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), TOOL_SCHEMAS[calls[0].name])
    else:
        assert text in CHOICES, text
