"""The OpenAPI document (api/openapi.py): built from the app's routes, for this server."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from halfmoon.api.auth import Authenticator
from halfmoon.api.frontdoor import FrontDoor
from halfmoon.api.openai_api import build_app
from halfmoon.api.openapi import document
from halfmoon.api.requests import Limits
from tests.conductor.conftest import MODEL, RunningApi


def test_a_route_without_an_operation_is_an_error(scripted: RunningApi) -> None:
    door = FrontDoor(scripted.backend, Limits(), Authenticator([]))
    app = build_app(door)

    @app.get("/undocumented")
    async def undocumented() -> dict[str, str]:
        return {}

    with pytest.raises(ValueError, match="/undocumented"):
        document(app, door)
    assert "/undocumented" not in document(_without(app, "/undocumented"), door)["paths"]


def _without(app: FastAPI, path: str) -> FastAPI:
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != path]
    return app


def test_without_tokens_nothing_asks_for_one(scripted: RunningApi) -> None:
    doc = httpx.get(f"{scripted.http_url}/openapi.json", timeout=10).json()
    operations = [op for path in doc["paths"].values() for op in path.values()]
    assert operations and all("security" not in op and "401" not in op["responses"] for op in operations)


def test_the_document_carries_the_servers_limits_and_model(scripted: RunningApi) -> None:
    doc = httpx.get(f"{scripted.http_url}/openapi.json", timeout=10).json()
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    # the base model's id, or any name: LoRA adapters are loaded and unloaded while serving
    assert request["model"]["anyOf"] == [{"const": MODEL}, {"type": "string", "minLength": 1}]
    limit = Limits().max_tokens
    kv = scripted.backend.kv_capacity_tokens
    assert request["max_tokens"]["anyOf"][0]["maximum"] == min(limit, kv - 1)
    assert set(request["priority_class"]["anyOf"][0]["enum"]) == {"", *scripted.backend.priority_classes}
