"""Run the front door: gRPC and OpenAI HTTP on one event loop, in front of one backend.

    await serve(backend, ServerConfig(...), stop_event, announce)

Ports are bound before anything is announced (a busy port is a clear error at startup); the
gRPC health service says SERVING only once both servers accept requests, and NOT_SERVING as
soon as shutdown starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from grpc_health.v1 import health

from halfmoon.api.admin import AdapterAdmin
from halfmoon.api.auth import Authenticator, load_admin_tokens, load_tokens
from halfmoon.conductor.backend import GenerationBackend
from halfmoon.api.tool_formats import AUTO, PARSERS
from halfmoon.api.frontdoor import FrontDoor
from halfmoon.api.grpc_api import GrpcTls, bind, build_server, set_serving
from halfmoon.api.openai_api import BodyLimit, build_app
from halfmoon.api.requests import Limits
from halfmoon.core.errors import ConfigError, HalfmoonError, InvalidRequestError


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where and how the front door listens.

    host: address both servers bind (127.0.0.1 = this machine only).
    grpc_port / http_port: 0 = any free port (the announced ports are the real ones).
    tls_cert / tls_key: PEM files; both or neither. TLS applies to gRPC and HTTP.
    api_token_file: bearer tokens, one per line; None = HALFMOON_API_TOKENS, else auth off.
    admin_token_file: admin bearer tokens (loading and unloading LoRA adapters), one per line;
        None = HALFMOON_ADMIN_TOKENS, else the admin API is off (403).
    lora_adapters: (name, path) of the LoRA adapters served from the start (`--lora NAME=PATH`),
        loaded once the backend has started; one that cannot be served stops the server.
    limits: per-request limits (see `Limits`).
    dashboard: serve the operator dashboard at /dashboard (docs/DASHBOARD.md).
    tool_call_parser: how the model's answers are read for tool calls (api/tool_formats.py):
        auto (from the chat template and family), hermes, llama3_json, mistral, pythonic.
    """

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    tls_cert: str | None = None
    tls_key: str | None = None
    api_token_file: str | None = None
    admin_token_file: str | None = None
    lora_adapters: tuple[tuple[str, str], ...] = ()
    limits: Limits = field(default_factory=Limits)
    dashboard: bool = True
    tool_call_parser: str = AUTO

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tool_call_parser not in PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {list(PARSERS)}, got {self.tool_call_parser!r}")
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be in 0..65535, got {getattr(self, name)}")

    @property
    def tls(self) -> GrpcTls | None:
        if self.tls_cert is None or self.tls_key is None:
            return None
        try:
            return GrpcTls(Path(self.tls_cert).read_bytes(), Path(self.tls_key).read_bytes())
        except OSError as e:
            raise ConfigError(f"cannot read the TLS certificate or key: {e}") from e

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True, slots=True)
class Endpoints:
    """What is listening, once ready."""

    host: str
    grpc_port: int
    http_port: int
    tls: bool
    auth: bool

    @property
    def grpc_target(self) -> str:
        return f"{_bracket(self.host)}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{_bracket(self.host)}:{self.http_port}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: `serve` owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _http_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as e:
        raise OSError(f"cannot bind HTTP to {_bracket(host)}:{port}: {e.strerror or e}") from e


async def _watch_health(backend: GenerationBackend, health_servicer: health.aio.HealthServicer,
                        period_s: float = 0.5) -> None:
    """Keep the gRPC health status in step with the backend (probes see a failed engine)."""
    serving = True
    while True:
        await asyncio.sleep(period_s)
        if backend.ready() != serving:
            serving = not serving
            await set_serving(health_servicer, serving)


async def load_adapters(admin: AdapterAdmin, adapters: Sequence[tuple[str, str]]) -> None:
    """The adapters served from the start, in order; the first that cannot be served raises,
    naming it (`--lora` of `halfmoon serve`: the server exits with the reason)."""
    for name, path in adapters:
        try:
            await admin.load(name, path)
        except HalfmoonError as e:
            raise ConfigError(f"--lora {name}={path}: {e.message if isinstance(e, InvalidRequestError) else e}") from e


Extension = Callable[[FastAPI, FrontDoor], object]  # adds routes to the HTTP app (e.g. dashboard.routes.mount)


async def serve(backend: GenerationBackend, config: ServerConfig, stop: asyncio.Event,
                announce: Callable[[Endpoints], None], extensions: Sequence[Extension] = ()) -> None:
    """Serve until `stop` is set, then shut down cleanly (health first, backend last).
    `extensions` add their routes to the HTTP app (the layers above the Conductor: the dashboard)."""
    auth = Authenticator(load_tokens(config.api_token_file))
    admin = Authenticator(load_admin_tokens(config.admin_token_file))
    tls = config.tls
    door = FrontDoor(backend, config.limits, auth, config.tool_call_parser, admin)
    health_servicer = health.aio.HealthServicer()
    grpc_server = build_server(door, health_servicer)
    grpc_port = bind(grpc_server, f"{_bracket(config.host)}:{config.grpc_port}", tls)
    sock = _http_socket(config.host, config.http_port)
    app = build_app(door)
    for extend in extensions:
        extend(app, door)
    http = _Uvicorn(uvicorn.Config(BodyLimit(app, door),
                                   log_level="warning", lifespan="off", timeout_graceful_shutdown=5,
                                   ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key))
    await backend.start()
    try:
        await load_adapters(AdapterAdmin(backend, admin), config.lora_adapters)
    except BaseException:  # nothing served yet: release the ports and the backend
        sock.close()
        await grpc_server.stop(None)
        await backend.stop()
        raise
    await grpc_server.start()
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    try:
        while not http.started:
            if http_task.done():
                http_task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped at startup")
            await asyncio.sleep(0.02)
        await set_serving(health_servicer, True)
        announce(Endpoints(config.host, grpc_port, sock.getsockname()[1], tls is not None, auth.enabled))
        stopped = asyncio.create_task(stop.wait())
        watcher = asyncio.create_task(_watch_health(backend, health_servicer))
        await asyncio.wait({stopped, http_task}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        watcher.cancel()
    finally:
        await set_serving(health_servicer, False)
        http.should_exit = True
        await grpc_server.stop(grace=2)
        with contextlib.suppress(asyncio.CancelledError):
            await http_task
        await backend.stop()
