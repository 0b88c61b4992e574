"""The HTTP API's OpenAPI 3.1 document, served at `/openapi.json` (as vLLM does).

Every route states its own operation where it is declared: `operation(...)` goes into the route
decorator's `openapi_extra`, naming its body, its answers and the error statuses it really
returns (each error is the shape `openai_schema.error_json` writes, its status the one
`conductor/errors.py` maps it to). `publish` turns the app's routes into the document when it is
first asked for, after every extension (the dashboard) has added its routes; a route without an
operation is a `ValueError` there, so nothing the app serves goes undocumented.

Auth: when the server has API tokens, the operations that need one carry the `bearer` security
scheme and a 401; without tokens, neither (the document describes the running server). The
admin API's operations (api/admin.py) carry the `admin` scheme and a 401 when the server has
admin tokens, else a 403 (the admin API is off).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from halfmoon.api import openapi_bodies as bodies
from halfmoon.api.frontdoor import FrontDoor

Schema = dict[str, Any]
AUTH_KEY = "x-halfmoon-auth"  # marks an operation that needs a token when auth is on
ADMIN_KEY = "x-halfmoon-admin"  # marks an operation of the admin API (an admin token)
_ERRORS = {
    400: "invalid request: `error.param` names the field",
    401: "missing or wrong bearer token",
    403: "the admin API is off on this server (it has no admin tokens); the message says how to turn it on",
    404: "not found (e.g. a model this server does not serve)",
    409: "conflicts with the server's state",
    413: "request body over the server's limit",
    429: "rejected under load or an objective it would miss; retry after `Retry-After` seconds",
    503: "the backend cannot serve right now (starting, stopping, a worker lost)",
}


def json_body(schema: Schema, content_type: str = "application/json") -> Schema:
    return {"content": {content_type: {"schema": schema}}}


def error(status: int) -> Schema:
    """The documented answer for an error status: OpenAI's error object."""
    if status == 429:
        return {"description": _ERRORS[429], "headers": {"Retry-After": {
            "description": "whole seconds, at least 1", "schema": {"type": "string", "pattern": "^[0-9]+$"}}},
                **json_body(bodies.ref("RateLimitError"))}
    return {"description": _ERRORS[status], **json_body(bodies.ref("Error"))}


def operation(summary: str, ok: dict[int, Schema], errors: Iterable[int] = (), *, body: Schema | None = None,
              auth: bool = False, parameters: list[Schema] | None = None, admin: bool = False) -> Schema:
    """A route's operation: `ok` maps its success statuses to their answers; `errors` lists the
    error statuses it returns (413 is added for a body, 401 by `publish` when auth is on; for
    `admin`, 401 or 403 as the server has admin tokens or not)."""
    responses = {str(code): answer for code, answer in ok.items()}
    codes = set(errors) | ({413} if body is not None else set())
    responses |= {str(code): error(code) for code in sorted(codes)}
    out: Schema = {"summary": summary, "responses": responses, AUTH_KEY: auth, ADMIN_KEY: admin}
    if body is not None:
        out["requestBody"] = {"required": True, **body}
    if parameters:
        out["parameters"] = parameters
    return out


def answer(description: str, content: Schema | None = None) -> Schema:
    return {"description": description, **(content or {})}


def components(door: FrontDoor) -> Schema:
    b = door.backend
    args = (door.limits, b.model, b.priority_classes, b.kv_capacity_tokens)
    return {"schemas": {
        "CompletionRequest": bodies.completion_request(*args, bodies.unspellable(b.tokenizer)),
        "ChatCompletionRequest": bodies.chat_request(*args),
        "Completion": bodies.COMPLETION, "ChatCompletion": bodies.CHAT_COMPLETION, "Usage": bodies.USAGE,
        "Prediction": bodies.PREDICTION, "ModelList": bodies.MODEL_LIST, "Health": bodies.HEALTH,
        "Error": bodies.ERROR, "RateLimitError": bodies.REJECTION,
        "LoadLoraAdapterRequest": bodies.load_adapter_request(b.model.id),
        "UnloadLoraAdapterRequest": bodies.UNLOAD_ADAPTER_REQUEST, "LoraAdapter": bodies.ADAPTER,
        "LoraAdapterList": bodies.ADAPTER_LIST},
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "an API token (--api-token-file / HALFMOON_API_TOKENS)"},
            "admin": {"type": "http", "scheme": "bearer",
                      "description": "an admin token (--admin-token-file / HALFMOON_ADMIN_TOKENS)"}}}


def document(app: FastAPI, door: FrontDoor) -> Schema:
    """The OpenAPI document of every route `app` serves."""
    paths: dict[str, Schema] = {}
    for route in app.routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        if route.openapi_extra is None:
            raise ValueError(f"route {sorted(route.methods)} {route.path} has no OpenAPI operation")
        for method in sorted(route.methods):
            paths.setdefault(route.path, {})[method.lower()] = _secured(
                {"operationId": route.name, **route.openapi_extra}, door.auth.enabled, door.admin.enabled)
    return {"openapi": "3.1.0", "info": {"title": "Halfmoon", "version": app.version,
                                         "description": "OpenAI-compatible front door of a Halfmoon cluster"},
            "paths": paths, "components": components(door)}


def _secured(op: Schema, auth_on: bool, admin_on: bool) -> Schema:
    op = dict(op)
    needs_token, needs_admin = op.pop(AUTH_KEY, False), op.pop(ADMIN_KEY, False)
    if needs_admin:
        op["responses"] = {**op["responses"], **({"401": error(401)} if admin_on else {"403": error(403)})}
        if admin_on:
            op["security"] = [{"admin": []}]
    elif needs_token and auth_on:
        op["security"] = [{"bearer": []}]
        op["responses"] = {**op["responses"], "401": error(401)}
    return op


def publish(app: FastAPI, door: FrontDoor) -> None:
    """Serve `document(app, door)` as the app's OpenAPI (built once, at the first request)."""
    built: list[Schema] = []

    def openapi() -> Schema:
        if not built:
            built.append(document(app, door))
        return built[0]

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
