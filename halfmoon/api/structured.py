"""Structured outputs as clients ask for them -> a `Constraint` (core/params.py).

    OpenAI   response_format: {"type": "text"}                      free text (the default)
                              {"type": "json_object"}               any JSON object
                              {"type": "json_schema",
                               "json_schema": {"name", "schema", "strict", "description"}}
                                                                    that schema; strict or not,
                                                                    it is enforced
    vLLM's   structured_outputs: exactly one of {"json": schema (an object),
    spelling                     "json_object": true, "regex": str, "choice": [str],
                                 "grammar": str (Lark or GBNF)}
    gRPC     GenerateRequest.constraint (one of json_object, json_schema, regex, choice, grammar)

Whether the grammar engine can enforce it is checked when it compiles (engine/grammar.py, off the
event loop in the front door): an unimplemented keyword is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any

from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.params import Constraint, ConstraintKind
from halfmoon.v1 import generation_pb2 as pb

RESPONSE_FORMAT = "response_format"
STRUCTURED = "structured_outputs"
_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_STRUCTURED_KEYS = {"json", "json_object", "regex", "choice", "grammar"}


def from_openai(body: dict[str, Any]) -> tuple[Constraint | None, str]:
    """The body's constraint and the field it came from (for errors); (None, "") for none."""
    fmt = _response_format(body.get(RESPONSE_FORMAT))
    structured = _structured(body.get(STRUCTURED))
    if fmt is not None and structured is not None:
        raise InvalidRequestError(STRUCTURED, f"give {RESPONSE_FORMAT} or {STRUCTURED}, not both")
    if fmt is not None:
        return fmt, RESPONSE_FORMAT
    if structured is not None:
        return structured, STRUCTURED
    return None, ""


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError(RESPONSE_FORMAT, 'must be an object with a "type"')
    kind = value["type"]
    extra = sorted(set(value) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if extra:
        raise InvalidRequestError(f"{RESPONSE_FORMAT}.{extra[0]}", f"is not a field of type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON)
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"))
    raise InvalidRequestError(f"{RESPONSE_FORMAT}.type", f"must be text, json_object or json_schema, got {kind!r}")


def _json_schema(value: Any) -> Constraint:
    field = f"{RESPONSE_FORMAT}.json_schema"
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be an object {name, schema, strict, description}")
    extra = sorted(set(value) - _SCHEMA_KEYS)
    if extra:
        raise InvalidRequestError(f"{field}.{extra[0]}", "unknown field")
    if not isinstance(value.get("name"), str) or not value["name"]:
        raise InvalidRequestError(f"{field}.name", "is required (a non-empty string)")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise InvalidRequestError(f"{field}.strict", "must be a boolean")
    if value.get("description") is not None and not isinstance(value["description"], str):
        raise InvalidRequestError(f"{field}.description", "must be a string")
    schema = value.get("schema")
    if schema is None:  # OpenAI allows a schema-less format: any JSON object
        return Constraint(ConstraintKind.JSON)
    return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(schema, f"{field}.schema"))


def _schema_text(schema: Any, field: str) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequestError(field, "must be a JSON Schema (an object)")
    # The client's key order is kept: the grammar writes an object's properties in the order the
    # schema lists them (sorting them would reorder every answer's fields)
    return json.dumps(schema)


def _structured(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(STRUCTURED, f"must be an object with one of {sorted(_STRUCTURED_KEYS)}")
    extra = sorted(set(value) - _STRUCTURED_KEYS)
    if extra:
        raise InvalidRequestError(f"{STRUCTURED}.{extra[0]}", "unknown field")
    if len(value) != 1:
        raise InvalidRequestError(STRUCTURED, f"give exactly one of {sorted(_STRUCTURED_KEYS)} (got {sorted(value)})")
    key = next(iter(value))
    item, field = value[key], f"{STRUCTURED}.{key}"
    if key == "json":
        return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(item, field))
    if key == "json_object":
        if item is not True:
            raise InvalidRequestError(field, "must be true")
        return Constraint(ConstraintKind.JSON)
    if key == "choice":
        return Constraint(ConstraintKind.CHOICE, _choice_text(item, field))
    if not isinstance(item, str) or not item:
        raise InvalidRequestError(field, "must be a non-empty string")
    return Constraint(ConstraintKind.REGEX if key == "regex" else ConstraintKind.GRAMMAR, item)


def _choice_text(choices: Any, field: str) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
    return json.dumps(choices)


def from_proto(msg: pb.Constraint) -> Constraint | None:
    """gRPC's Constraint (unset: None)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    field = f"constraint.{kind}"
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidRequestError(field, "must be true (or leave the constraint unset)")
        return Constraint(ConstraintKind.JSON)
    if kind == "json_schema":
        try:
            schema = json.loads(msg.json_schema)
        except ValueError:
            raise InvalidRequestError(field, "is not valid JSON") from None
        return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(schema, field))
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, _choice_text(list(msg.choice.choices), field))
    text = getattr(msg, kind)
    if not text:
        raise InvalidRequestError(field, "must be a non-empty string")
    return Constraint(ConstraintKind.REGEX if kind == "regex" else ConstraintKind.GRAMMAR, text)
