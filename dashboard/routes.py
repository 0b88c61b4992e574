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

from conductor.errors import ServiceUnavailableError, UnauthenticatedError
from conductor.frontdoor import FrontDoor
from core.errors import InvalidRequestError
from dashboard.live import LiveView
from dashboard.sizing import (THIS_CLUSTER, SizingJobs, cost_model, parse_trace, sweep_request,
                              trace_summary)
from sim import builtin
from sim.trace import TraceRequest, read_trace

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = {"style.css": "text/css", "app.js": "text/javascript", "plot.js": "text/javascript"}
SAMPLE_TRACE = Path(__file__).resolve().parents[1] / "bench" / "data" / "sample_trace.jsonl"
COOKIE = "halfmoon_dashboard"
LIVE_MINUTES = 10
PAGE_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                           "script-src 'self'; frame-ancestors 'none'"}


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

    @app.get("/dashboard")
    async def page(request: Request) -> Response:
        try:
            board.authorized(request)
        except UnauthenticatedError:
            return login_page()
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @app.post("/dashboard/login")
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

    @app.post("/dashboard/logout")
    async def logout() -> Response:
        response = RedirectResponse("/dashboard", status_code=303)
        response.delete_cookie(COOKIE, path="/dashboard")
        return response

    @app.get("/dashboard/static/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/api/live")
    async def live(request: Request) -> Response:
        board.authorized(request)
        return JSONResponse(board.live.document(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/api/traffic.jsonl")
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

    @app.get("/dashboard/api/sizing/options")
    async def options(request: Request) -> Response:
        board.authorized(request)
        return JSONResponse(await asyncio.to_thread(board.options))

    @app.get("/dashboard/api/cost-model")
    async def cost(request: Request) -> Response:
        board.authorized(request)
        if door.backend.cost is None:
            raise ServiceUnavailableError("the cluster has no cost model yet (still starting); retry")
        return JSONResponse(json.loads(door.backend.cost.to_json()), headers={"Cache-Control": "no-store"})

    @app.post("/dashboard/api/sizing/jobs")
    async def start(request: Request) -> Response:
        board.authorized(request)
        try:
            body = await request.json()
        except ValueError as e:
            raise InvalidRequestError("body", f"not valid JSON: {e}") from e
        return JSONResponse(await asyncio.to_thread(board.start, body), status_code=202)

    @app.get("/dashboard/api/sizing/jobs/{job_id}")
    async def job(job_id: str, request: Request) -> Response:
        board.authorized(request)
        return JSONResponse(board.jobs.get(job_id).view(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/api/sizing/jobs/{job_id}/values.yaml")
    async def values(job_id: str, request: Request) -> Response:
        board.authorized(request)
        found = board.jobs.get(job_id)
        if found.result is None:
            raise InvalidRequestError("job", f"sizing job {job_id} has no result yet ({found.state})")
        return PlainTextResponse(found.result["helm_values"], media_type="application/yaml", headers={
            "Content-Disposition": f'attachment; filename="halfmoon-{job_id}-values.yaml"'})

    return board
