"""The dashboard's HTTP routes on the Conductor's FastAPI app (docs/DASHBOARD.md):

    GET  /dashboard                         the page (401 + a sign-in form without a token)
    POST /dashboard/login, /dashboard/logout
    GET  /dashboard/static/{file}           its CSS and scripts (no token needed: nothing secret)
    GET  /dashboard/api/live                workers, cluster figures, the last minutes' series
    GET  /dashboard/api/traffic.jsonl       the recorded traffic as a Mooncake trace (?minutes=10)
    GET  /dashboard/api/sizing/options      traces and profiles the sizing form offers
    GET  /dashboard/api/cost-model          the cost model admission prices with (`halfmoon profile`'s
                                            JSON; the admission bench's offline optimum reads it)
    POST /dashboard/api/sizing/jobs         start a sweep (202); GET .../jobs/{id}[/values.yaml]

Auth is the API's: a bearer token in `Authorization`, or the cookie the sign-in form sets.
Errors are the API's error shape and statuses (conductor/errors.py).
"""

from __future__ import annotations

import asyncio
import html
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse

from halfmoon.conductor.errors import ServiceUnavailableError, UnauthenticatedError
from halfmoon.api.frontdoor import FrontDoor
from halfmoon.api.openapi import answer, json_body, operation
from halfmoon.core.errors import InvalidRequestError
from halfmoon.dashboard.live import LiveView
from halfmoon.dashboard.sizing import (THIS_CLUSTER, SizingJobs, cost_model, parse_trace, sweep_request,
                              trace_summary)
from halfmoon.sim import builtin
from halfmoon.sim.trace import TraceRequest, read_trace

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = {"style.css": "text/css", "app.js": "text/javascript", "plot.js": "text/javascript"}
SAMPLE_TRACE = Path(__file__).resolve().parents[1] / "bench" / "data" / "sample_trace.jsonl"
COOKIE = "halfmoon_dashboard"
LIVE_MINUTES = 10
PAGE_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                           "script-src 'self'; frame-ancestors 'none'"}


_TEXT = {"schema": {"type": "string"}}
_HTML = {"content": {"text/html": _TEXT}}
_LOGIN_FORM = {"content": {"application/x-www-form-urlencoded": {"schema": {
    "type": "object", "properties": {"token": {"type": "string"}}}}}}
_JOB = {"type": "object", "required": ["id", "state", "done", "total"], "properties": {
    "id": {"type": "string"}, "state": {"enum": ["running", "done", "failed"]}, "done": {"type": "integer"},
    "total": {"type": "integer"}, "source": {"type": "string"}, "rows": {"type": "array"},
    "best": {}, "helm_values": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "error": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
# The sweep form (dashboard/sizing.py's rules; the shapes it spans must be at most MAX_SHAPES).
_SWEEP = {"type": "object", "required": ["trace", "workers", "device_tokens", "host_tokens", "ttft_ms", "tbt_ms",
                                         "speed"], "properties": {
    "trace": {"enum": ["sample", "live", "upload"]}, "live_minutes": {"type": "number"},
    "trace_text": {"type": "string", "description": "Mooncake JSONL, for trace: upload"},
    "profile": {"type": "string"}, "workers": {"type": "integer", "minimum": 2, "maximum": 64},
    "device_tokens": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1, "maxItems": 8},
    "host_tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": 8},
    "ttft_ms": {"type": "number", "minimum": 0}, "tbt_ms": {"type": "number", "minimum": 0},
    "speed": {"type": "number", "minimum": 1e-3}}}


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


class Dashboard:
    """The routes' state: the front door it reads, the live view's history, the sizing jobs."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.live = LiveView(door)
        self.jobs = SizingJobs()
        self._sample: tuple[TraceRequest, ...] | None = None

    def sample(self) -> tuple[TraceRequest, ...]:
        """The bundled sample trace, read once."""
        if self._sample is None:
            self._sample = tuple(read_trace(SAMPLE_TRACE))
        return self._sample

    def authorized(self, request: Request) -> None:
        """Raises UnauthenticatedError unless auth is off or the header / cookie holds a token."""
        header = request.headers.get("authorization")
        cookie = request.cookies.get(COOKIE)
        if header is None and cookie:
            header = f"Bearer {cookie}"
        self.door.auth.check(header)

    def options(self) -> dict[str, Any]:
        sample = self.sample()
        live = self.live_trace(LIVE_MINUTES)
        n, span = trace_summary(sample)
        traces = [{"name": "sample", "label": f"bundled sample ({n} requests)", "requests": n, "duration_s": span}]
        traces.append({"name": "live", "label": f"live traffic (last {LIVE_MINUTES} min, {len(live)} requests)",
                       "requests": len(live), "duration_s": trace_summary(live)[1]})
        profiles = [{"name": THIS_CLUSTER, "label": "this cluster (profiled here)"}]
        profiles += [{"name": name, "label": name} for name in builtin.names()]
        backend = self.door.backend
        slo = backend.admission_config.classes()[backend.admission_config.default_class]
        device = backend.kv_capacity_tokens or 65536
        return {"traces": traces, "profiles": profiles, "max_upload_bytes": self.door.limits.max_request_bytes,
                "defaults": {"trace": "sample", "profile": THIS_CLUSTER, "workers": 4, "device_tokens": [device],
                             "host_tokens": [0], "ttft_ms": slo.ttft_ms or 0, "tbt_ms": slo.tbt_ms or 0,
                             "speed": 1.0, "live_minutes": LIVE_MINUTES}}

    def live_trace(self, minutes: float) -> tuple[TraceRequest, ...]:
        """What the front door recorded in the last `minutes`, as a trace."""
        rows = self.door.traffic.rows(since=time.time() - minutes * 60)
        return tuple(TraceRequest(n, r.timestamp_ms, r.input_length, r.output_length, r.hash_ids)
                     for n, r in enumerate(rows, start=1))

    def start(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise InvalidRequestError("body", "must be a JSON object")
        kind = body.get("trace")
        if kind == "sample":
            trace, source = self.sample(), "bundled sample trace"
        elif kind == "live":
            minutes = body.get("live_minutes", LIVE_MINUTES)
            if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not 0 < minutes <= 24 * 60:
                raise InvalidRequestError("live_minutes", f"must be a number of minutes in (0, 1440], got {minutes!r}")
            trace = self.live_trace(minutes)
            if not trace:
                raise InvalidRequestError("trace", f"no live traffic was recorded in the last {minutes:g} minutes")
            source = f"live traffic, last {minutes:g} min"
        elif kind == "upload":
            text = body.get("trace_text")
            if not isinstance(text, str) or not text.strip():
                raise InvalidRequestError("trace_text", "an uploaded trace needs the file's text")
            trace, source = parse_trace(text, "uploaded trace"), "uploaded trace"
        else:
            raise InvalidRequestError("trace", f"must be 'sample', 'live' or 'upload', got {kind!r}")
        backend = self.door.backend
        cost = cost_model(str(body.get("profile", THIS_CLUSTER)), backend.cost)
        chunk = 512
        request = sweep_request(body, trace, source, cost, backend.admission_config, backend.block_size, chunk)
        return self.jobs.start(request).view()


def login_page(error: str | None = None) -> HTMLResponse:
    text = (STATIC / "login.html").read_text()
    note = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return HTMLResponse(text.replace("<!--ERROR-->", note), status_code=401, headers=PAGE_HEADERS)


def mount(app: FastAPI, door: FrontDoor) -> Dashboard:
    """Add the dashboard's routes to the front door's app."""
    board = Dashboard(door)

    @app.get("/dashboard", openapi_extra=operation("The dashboard page", {
        200: answer("the page", _HTML), 401: answer("the sign-in form (no or a wrong token)", _HTML)}))
    async def page(request: Request) -> Response:
        try:
            board.authorized(request)
        except UnauthenticatedError:
            return login_page()
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @app.post("/dashboard/login", openapi_extra=operation("Sign in with an API token", {
        303: answer("signed in: to /dashboard, with the session cookie when auth is on"),
        401: answer("the sign-in form, saying why", _HTML)}, body=_LOGIN_FORM))
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0].strip()
        try:
            door.auth.check(f"Bearer {token}" if token else None)
        except UnauthenticatedError as e:
            return login_page(str(e))
        response = RedirectResponse("/dashboard", status_code=303)
        if door.auth.enabled:
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https", path="/dashboard")
        return response

    @app.post("/dashboard/logout", openapi_extra=operation("Sign out", {
        303: answer("signed out: to /dashboard, the cookie cleared")}))
    async def logout() -> Response:
        response = RedirectResponse("/dashboard", status_code=303)
        response.delete_cookie(COOKIE, path="/dashboard")
        return response

    @app.get("/dashboard/static/{name}", openapi_extra=operation("The page's styles and scripts", {
        200: answer("the file", {"content": {t: _TEXT for t in sorted(set(ASSETS.values()))}}),
        404: answer("no such file", {"content": {"text/plain": _TEXT}})}, parameters=[
            {**_path("name"), "schema": {"type": "string", "enum": sorted(ASSETS)}}]))
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/api/live", openapi_extra=operation("Workers, cluster figures, recent series", {
        200: answer("the live document", json_body({"type": "object"}))}, auth=True))
    async def live(request: Request) -> Response:
        board.authorized(request)
        return JSONResponse(board.live.document(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/api/traffic.jsonl", openapi_extra=operation(
        "The recorded traffic as a Mooncake trace", {200: answer("one JSON request a line", {
            "content": {"application/jsonl": _TEXT}})}, (400,), auth=True, parameters=[{
                "name": "minutes", "in": "query", "required": False, "schema": {
                    "type": "number", "exclusiveMinimum": 0, "maximum": 24 * 60},
                "description": f"the last minutes; default {LIVE_MINUTES}"}]))
    async def traffic(request: Request, minutes: str = str(LIVE_MINUTES)) -> Response:
        board.authorized(request)
        try:
            span = float(minutes)
        except ValueError:
            span = -1.0
        if not 0 < span <= 24 * 60:
            raise InvalidRequestError("minutes", f"must be a number of minutes in (0, 1440], got {minutes!r}")
        rows = door.traffic.rows(since=time.time() - span * 60)
        text = "".join(json.dumps(r.as_json()) + "\n" for r in rows)
        return PlainTextResponse(text, media_type="application/jsonl", headers={
            "Content-Disposition": f'attachment; filename="halfmoon-traffic-{span:g}min.jsonl"'})

    @app.get("/dashboard/api/sizing/options", openapi_extra=operation("What the sizing form offers", {
        200: answer("traces, profiles, defaults", json_body({"type": "object"}))}, auth=True))
    async def options(request: Request) -> Response:
        board.authorized(request)
        return JSONResponse(await asyncio.to_thread(board.options))

    @app.get("/dashboard/api/cost-model", openapi_extra=operation("The cluster's cost model (bench serve's optimum)", {
        200: answer("the cost model's JSON (conductor/cost_model.py)", json_body({"type": "object"}))}, (503,),
        auth=True))
    async def cost(request: Request) -> Response:
        board.authorized(request)
        if door.backend.cost is None:
            raise ServiceUnavailableError("the cluster has no cost model yet (still starting); retry")
        return JSONResponse(json.loads(door.backend.cost.to_json()), headers={"Cache-Control": "no-store"})

    @app.post("/dashboard/api/sizing/jobs", openapi_extra=operation("Start a sizing sweep", {
        202: answer("started", json_body(_JOB))}, (400, 409), body=json_body(_SWEEP), auth=True))
    async def start(request: Request) -> Response:
        board.authorized(request)
        try:
            body = await request.json()
        except ValueError as e:
            raise InvalidRequestError("body", f"not valid JSON: {e}") from e
        return JSONResponse(await asyncio.to_thread(board.start, body), status_code=202)

    @app.get("/dashboard/api/sizing/jobs/{job_id}", openapi_extra=operation("A sizing job's progress", {
        200: answer("the job", json_body(_JOB))}, (404,), auth=True, parameters=[_path("job_id")]))
    async def job(job_id: str, request: Request) -> Response:
        board.authorized(request)
        return JSONResponse(board.jobs.get(job_id).view(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/api/sizing/jobs/{job_id}/values.yaml", openapi_extra=operation(
        "A finished job's Helm values", {200: answer("Helm values", {"content": {"application/yaml": _TEXT}})},
        (400, 404), auth=True, parameters=[_path("job_id")]))
    async def values(job_id: str, request: Request) -> Response:
        board.authorized(request)
        found = board.jobs.get(job_id)
        if found.result is None:
            raise InvalidRequestError("job", f"sizing job {job_id} has no result yet ({found.state})")
        return PlainTextResponse(found.result["helm_values"], media_type="application/yaml", headers={
            "Content-Disposition": f'attachment; filename="halfmoon-{job_id}-values.yaml"'})

    return board
