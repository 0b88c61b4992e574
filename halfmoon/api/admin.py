"""The admin API: LoRA adapters loaded and unloaded while serving, the same over HTTP and gRPC.

    HTTP (vLLM's spelling)                                gRPC                 answer
    POST /v1/load_lora_adapter   {lora_name, lora_path}   LoadAdapter          the adapter
    POST /v1/unload_lora_adapter {lora_name}              UnloadAdapter        the adapter
    GET  /v1/lora_adapters                                ListAdapters         every adapter

Every call needs an admin token (`--admin-token-file` / HALFMOON_ADMIN_TOKENS, api/auth.py); the
API tokens do not open it. A server started without admin tokens answers 403 / PERMISSION_DENIED
with how to turn it on. A load reads and checks the adapter off the event loop (the registry,
conductor/adapters.py), then lets the backend read it ahead of its first request
(`GenerationBackend.prepare_adapter`); a refused adapter is a 400 naming the field and the one
reason, and is not served. `--lora NAME=PATH` at start goes through the same `load`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, NamedTuple

from halfmoon.api.auth import Authenticator
from halfmoon.conductor.adapters import NAME, AdapterInfo, AdapterRegistry
from halfmoon.conductor.backend import GenerationBackend
from halfmoon.conductor.errors import ResourceNotFoundError
from halfmoon.core.adapters import InvalidAdapterError
from halfmoon.core.errors import InvalidRequestError

NAME_RULE = "1-128 letters, digits and ._:/@+- , starting with a letter or digit"


class Fields(NamedTuple):
    """How an API spells the request's two fields (what a 400 names)."""

    name: str
    path: str


HTTP_FIELDS = Fields("lora_name", "lora_path")
GRPC_FIELDS = Fields("name", "path")


class AdapterAdmin:
    """The three verbs over one backend's registry, behind the admin tokens."""

    def __init__(self, backend: GenerationBackend, admin: Authenticator) -> None:
        self.backend, self.admin = backend, admin

    def check(self, authorization: str | None) -> None:
        """PermissionDeniedError when the admin API is off, UnauthenticatedError on a missing or
        wrong admin token."""
        self.admin.check_admin(authorization)

    async def load(self, name: str, path: str, fields: Fields = HTTP_FIELDS) -> AdapterInfo:
        """Serve the adapter at `path` as `name` (the same files again: a no-op); InvalidRequestError
        naming the field, ConflictError for other files under a served name."""
        registry = self._registry(fields)
        _check_name(name, registry, fields.name)
        known = name in registry.names()
        try:
            info = await asyncio.to_thread(registry.load, name, path)
        except InvalidAdapterError as e:
            raise InvalidRequestError(fields.path, str(e)) from e
        try:
            await self.backend.prepare_adapter(info.ref)
        except BaseException as e:
            if not known:  # never served: take the name back
                registry.unload(name)
            if isinstance(e, InvalidAdapterError):
                raise InvalidRequestError(fields.path, str(e)) from e
            raise
        return info

    def unload(self, name: str) -> AdapterInfo:
        """Stop serving `name` (requests naming it from now on: 404; running ones finish)."""
        registry = self.backend.adapters
        if registry is None:
            raise ResourceNotFoundError(f"no adapter named {name!r} is loaded: this server serves no LoRA adapters")
        return registry.unload(name)

    def list(self) -> list[AdapterInfo]:
        registry = self.backend.adapters
        return registry.list() if registry is not None else []

    def _registry(self, fields: Fields) -> AdapterRegistry:
        registry = self.backend.adapters
        if registry is None:
            raise InvalidRequestError(fields.name, "this server serves no LoRA adapters")
        if registry.shapes is None:
            raise InvalidRequestError(fields.name, registry.why_off)
        return registry


def _check_name(name: str, registry: AdapterRegistry, field: str) -> None:
    if not NAME.fullmatch(name):  # fullmatch: `$` alone lets a trailing newline through
        raise InvalidRequestError(field, f"{name[:64]!r} is not an adapter name: {NAME_RULE}")
    if name == registry.base_id:
        raise InvalidRequestError(field, f"{name!r} is the base model's name")


def adapter_json(info: AdapterInfo) -> dict[str, Any]:
    """An adapter as the HTTP admin API answers it (openapi_bodies.ADAPTER)."""
    return {"name": info.name, "path": info.path, "digest": info.digest, "rank": info.rank,
            "target_modules": list(info.targets), "base_model": info.base_model,
            "load_ms": round(info.load_ms, 3), "loaded_at": int(info.loaded_at)}


def parse_load(body: Any) -> tuple[str, str]:
    """(name, path) of a load body: {"lora_name", "lora_path", "load_inplace": false}."""
    obj = _object(body, ("lora_name", "lora_path", "load_inplace"))
    if obj.get("load_inplace") not in (None, False):
        raise InvalidRequestError("load_inplace", "not implemented: unload the adapter, then load the new weights")
    return _string(obj, "lora_name"), _string(obj, "lora_path")


def parse_unload(body: Any) -> str:
    """The name of an unload body: {"lora_name"} (vLLM's `lora_int_id` is accepted, not used)."""
    return _string(_object(body, ("lora_name", "lora_int_id")), "lora_name")


def _object(body: Any, keys: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - set(keys))
    if unknown:
        raise InvalidRequestError(unknown[0], f"unknown field (the body takes {', '.join(keys)})")
    return body


def _string(obj: Mapping[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(key, "is required: a non-empty string")
    return value
