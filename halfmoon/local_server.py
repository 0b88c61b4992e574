"""A minimal local HTTP entry point to the co-located engine (stdlib only).

    POST /generate  {"prompt": "..."} | {"prompt_ids": [...]} | {"messages": [...]}
                    + max_tokens, temperature, top_p, top_k, seed, ignore_eos, stop, stream
    GET  /health

The full gRPC and OpenAI-compatible APIs replace this in the API issue; this keeps `make serve`
useful until then. One engine thread runs `engine.step()`; HTTP threads wait on per-request queues.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine.engine import Engine
from engine.errors import HalfmoonError, InvalidRequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

_PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop")


class EngineLoop:
    """Owns the engine thread and routes each step's outputs to the waiting requests."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, queue.Queue[RequestOutput]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, ids: list[int], params: SamplingParams) -> tuple[str, queue.Queue[RequestOutput]]:
        q: queue.Queue[RequestOutput] = queue.Queue()
        rid = self.engine.add_request(ids, params)
        self._queues[rid] = q
        self._wake.set()
        return rid, q

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for out in self.engine.step():
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put(out)
                if out.finished:
                    self._queues.pop(out.request_id, None)


def parse_request(body: dict[str, Any], engine: Engine) -> tuple[list[int], SamplingParams, bool]:
    """JSON body -> (prompt ids, params, stream); raises InvalidRequestError naming the field."""
    unknown = set(body) - {"prompt", "prompt_ids", "messages", "stream", *_PARAM_FIELDS}
    if unknown:
        raise InvalidRequestError(sorted(unknown)[0], "unknown field")
    sources = [k for k in ("prompt", "prompt_ids", "messages") if k in body]
    if len(sources) != 1:
        raise InvalidRequestError("prompt", "give exactly one of prompt, prompt_ids, messages")
    tok = engine.tokenizer
    if "prompt_ids" in body:
        ids = body["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise InvalidRequestError("prompt_ids", "must be a list of integers")
    elif "messages" in body:
        ids = tok.encode(tok.apply_chat_template(body["messages"]))
    else:
        if not isinstance(body["prompt"], str):
            raise InvalidRequestError("prompt", "must be a string")
        ids = tok.encode(body["prompt"])
    try:
        params = SamplingParams(**{k: body[k] for k in _PARAM_FIELDS if k in body})
    except TypeError as e:
        raise InvalidRequestError("params", str(e)) from e
    return ids, params, bool(body.get("stream", False))


class Handler(BaseHTTPRequestHandler):
    loop: EngineLoop  # set on the subclass made by `make_server`
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet by default
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": "GET /health or POST /generate"}})

    def do_POST(self) -> None:
        if self.path != "/generate":
            self._json(404, {"error": {"message": "POST /generate"}})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not isinstance(body, dict):
                raise InvalidRequestError("body", "must be a JSON object")
            ids, params, stream = parse_request(body, self.loop.engine)
            rid, q = self.loop.submit(ids, params)
        except json.JSONDecodeError as e:
            self._json(400, {"error": {"message": f"invalid JSON: {e}", "field": "body"}})
            return
        except InvalidRequestError as e:
            self._json(400, {"error": {"message": str(e), "field": e.field}})
            return
        except HalfmoonError as e:
            self._json(400, {"error": {"message": str(e)}})
            return
        self._respond(rid, ids, q, stream)

    def _respond(self, rid: str, ids: list[int], q: queue.Queue[RequestOutput], stream: bool) -> None:
        try:
            if stream:
                self._stream(q)
            else:
                out = _wait_final(q)
                assert out.result is not None
                r = out.result
                self._json(200, {"id": rid, "prompt_ids": ids, "output_ids": r.output_ids, "text": r.text,
                                 "finish_reason": r.finish_reason.value, "ttft_ms": r.ttft_ms,
                                 "tpot_ms": r.tpot_ms})
        except (BrokenPipeError, ConnectionResetError):
            self.loop.abort(rid)  # the client went away: free its KV now

    def _stream(self, q: queue.Queue[RequestOutput]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Connection", "close")
        self.end_headers()
        while True:
            out = q.get()
            line = {"token_ids": out.new_token_ids, "text": out.new_text}
            if out.finished:
                line["finish_reason"] = out.finish_reason.value if out.finish_reason else None
            self.wfile.write(json.dumps(line).encode() + b"\n")
            self.wfile.flush()
            if out.finished:
                return

    def _json(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _wait_final(q: queue.Queue[RequestOutput]) -> RequestOutput:
    while True:
        out = q.get()
        if out.finished:
            return out


def make_server(loop: EngineLoop, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"loop": loop})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
