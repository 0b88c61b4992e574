"""The config dataclasses as flag tables: what each field's flag is called where it is not
`--field-name`, and which fields are no flag and why. `cli.flags` generates the rest.

Importing this module imports the config classes (torch, via engine.config): commands import it
only when their own parser is built.
"""

from __future__ import annotations

import dataclasses

from halfmoon.conductor.admission import AdmissionConfig, Policy
from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.api.requests import Limits
from halfmoon.conductor.serve_defaults import HOST_CACHE_GB, SERVE_DTYPE, SERVE_PREFILL_MAX_SEQS, SERVE_QUANTIZATION
from halfmoon.api.server import ServerConfig
from halfmoon.api.tool_formats import PARSERS
from halfmoon.core.logs import FORMATS, LEVELS, LogConfig
from halfmoon.core.tracing import PROTOCOLS, SAMPLERS, TracingConfig
from halfmoon.engine.config import AUTO, QUANTIZATIONS, EngineConfig
from halfmoon.transport.config import TransportConfig

from halfmoon.cli.flags import Component, Flag
from halfmoon.cli.planner_flags import PLANNER

ENGINE = Component(
    EngineConfig, "engine",
    flags={
        "model": Flag(help="alias (smollm2), GGUF file or HF folder"),
        "dtype": Flag(choices=("float32", "bfloat16")),
        "quantization": Flag(choices=QUANTIZATIONS),
        # Kept from the first CLI; in cluster mode each worker pins its own (--worker-threads).
        "num_threads": Flag("threads", help="torch CPU threads (default: all cores)"),
        "attention_backend": Flag(choices=("torch", "flashinfer")),
        "tp": Flag(help="tensor-parallel size: the engine spans this many processes (gloo on CPU), each "
                        "with its share of heads, MLP and vocabulary; 1 = one process"),
    },
    excluded={
        "redis_url": "`serve` sets it: --redis-url, --no-redis, else the embedded Redis it starts",
        "worker_id": "the cluster names each worker",
        "node_id": "the worker's node (hostname) in the cluster",
        "max_prefill_seqs": "a prefill worker's, set by serve's --prefill-max-seqs (the cluster's field)",
    })

# `serve` runs `--dtype auto` by default (conductor/serve_defaults.py, which `halfmoon sim` reads too), and
# `profile` measures what serve runs, so a cost model profiled with no flags is serve's (the
# router's, admission's and the simulator's). `generate` keeps the fields' defaults: fp32, the
# token-exact reference.
PRECISION_FLAGS = {
    "dtype": Flag(choices=(AUTO, "float32", "bfloat16"), default=SERVE_DTYPE,
                  help=f"compute and KV dtype (default {SERVE_DTYPE}: bfloat16 on CUDA and on a CPU with oneDNN's "
                       "bf16 path, else float32: the most goodput within fp32's quality bounds, said at start; "
                       "float32 with --quantization none is the token-exact mode)"),
    "quantization": Flag(choices=QUANTIZATIONS, default=SERVE_QUANTIZATION,
                         help=f"weight-only quantization of the dense layers, CPU only (default {SERVE_QUANTIZATION})"),
}
PROFILE_ENGINE = dataclasses.replace(ENGINE, flags={**ENGINE.flags, **PRECISION_FLAGS})

# `serve` keeps a host DRAM tier by default too. The engine commands serve one request: no host tier.
SERVE_ENGINE = dataclasses.replace(ENGINE, excluded={
    **ENGINE.excluded,
    "tp": "serve sets each role's own: --prefill-tp and --decode-tp (the cluster's fields)",
}, flags={
    **ENGINE.flags,
    **PRECISION_FLAGS,
    "host_cache_gb": Flag(default=HOST_CACHE_GB,
                          help=f"host DRAM KV tier in GiB, one shared-memory arena per node (default {HOST_CACHE_GB:g}; 0 = off): the "
                               "device tier's evicted blocks spill there and are hits again"),
})

TRANSPORT = Component(
    TransportConfig, "KV transport (cluster mode)",
    flags={
        "backend": Flag("kv-transport", choices=("auto", "ucxx", "tcp"),
                        help="KV transfer between workers (auto = ucxx, else tcp with a warning)"),
        # None: `serve` derives it (127.0.0.1, or 0.0.0.0 with --ray-address).
        "host": Flag("kv-host", default=None,
                     help="where decode workers' KV receivers bind (default 127.0.0.1; with "
                          "--ray-address 0.0.0.0, advertised as the node's IP)"),
        "port": Flag("kv-port", help="KV receiver port (0 = any free port)"),
        "secret_file": Flag("kv-secret-file"),
        "timeout_s": Flag("kv-timeout-s"),
        "max_inflight_mb": Flag("kv-max-inflight-mb"),
    })

CLUSTER = Component(
    ClusterConfig, "cluster (default: 1 prefill + 1 decode worker as Ray actors)",
    nested={"transport": TRANSPORT, "planner": PLANNER},
    flags={
        "prefill_max_seqs": Flag(default=SERVE_PREFILL_MAX_SEQS,
                                 help=f"prompts a prefill worker's engine steps at once (default "
                                      f"{SERVE_PREFILL_MAX_SEQS}: one a step, the admission window's shortest "
                                      "first; a long prompt is still chunked by --max-num-batched-tokens)"),
    },
    excluded={
        "engine": "built from the engine flags by `serve` (one EngineConfig for both modes)",
        "model_id": "derived: --served-model-name, else the model's file or folder name",
        "tracing": "built from the tracing flags by `serve`, the OTEL_* environment resolved (both modes)",
        "log": "built from the log flags by `serve` (both modes)",
    })

LIMITS = Component(
    Limits, "limits",
    flags={
        "max_tokens": Flag("max-tokens-limit", help="largest max_tokens a request may ask"),
        "max_stop_chars": Flag(help="longest stop string, in characters"),
        "max_id_chars": Flag(help="longest request id / cache salt, in printable characters"),
    })

SERVER = Component(
    ServerConfig, "front door",
    flags={
        "host": Flag(help="address to bind (0.0.0.0 = every interface)"),
        "grpc_port": Flag(help="gRPC port (0 = any free port)"),
        "http_port": Flag(help="HTTP port (0 = any free port)"),
        "tls_cert": Flag(help="PEM certificate (TLS for gRPC and HTTP)"),
        "tls_key": Flag(help="PEM private key"),
        "tool_call_parser": Flag(choices=PARSERS, help="how answers are read for tool calls: auto (the chat "
                                 "template's markers, else the family: Gemma 3 pythonic, else hermes), hermes, "
                                 "llama3_json, mistral, pythonic"),
        "admin_token_file": Flag(help="admin bearer tokens, one per line: they open the admin API (LoRA adapters "
                                      "loaded and unloaded while serving); None = HALFMOON_ADMIN_TOKENS, else the "
                                      "admin API answers 403"),
    },
    nested={"limits": LIMITS},
    excluded={"lora_adapters": "serve's --lora NAME=PATH (repeatable; env HALFMOON_LORA=NAME=PATH,...)"})

ADMISSION = Component(
    AdmissionConfig, "admission and priority classes (conductor/admission.py)",
    flags={
        "admission": Flag(choices=tuple(p.value for p in Policy),
                          help="admission policy: none, queue-threshold, early, predictive (Mooncake's: "
                               "reject what the load predicts will miss its SLOs)"),
        "default_class": Flag(choices=tuple(AdmissionConfig().classes()),
                              help="the priority class of a request that names none"),
        # A class with neither objective (batch, by default) is shed first under load.
        **{f"{cls}_{slo}_ms": Flag(help=f"{slo.upper()} objective of the `{cls}` class in ms; a request's own "
                                        f"{slo}_ms overrides it (0 = none)")
           for cls in ("interactive", "standard", "batch") for slo in ("ttft", "tbt")},
    })

TRACING = Component(
    TracingConfig, "tracing (OpenTelemetry over OTLP; unset options come from the OTEL_* variables)",
    flags={
        "tracing": Flag(help="export one OpenTelemetry trace per request (off by default; "
                             "docs/OPERATIONS.md, Tracing)"),
        "otlp_protocol": Flag(choices=PROTOCOLS),
        "trace_sampler": Flag(choices=SAMPLERS),
    })

LOGGING = Component(
    LogConfig, "logs",
    flags={"log_format": Flag(choices=FORMATS), "log_level": Flag(choices=LEVELS)})

# The components whose flags `halfmoon serve` has, and the one the engine commands share.
SERVE = (SERVER, ADMISSION, CLUSTER, SERVE_ENGINE, TRACING, LOGGING)
