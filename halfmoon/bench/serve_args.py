"""The flags of `halfmoon bench serve` and the workloads they name (bench/serve_bench.py runs them;
bench/prefix_bench.py and bench/admission_bench.py share them)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from halfmoon.bench.workload import Caps, Workload, chat_workload, trace_workload
from halfmoon.conductor.serve_defaults import serve_admission
from halfmoon.sim.conversations import ConversationShape, conversation_trace, write_trace

DEFAULT_SERVE_ARGS = "--colocated --threads 2 --no-redis"
BASELINE_ARGS = "--colocated --threads 2"
CLUSTER_ARGS = "--prefill 1 --decode 1 --worker-threads 1"
SERVE_SLO = serve_admission()  # the benches' SLOs default to serve's `standard` class


def add_replay_flags(p: argparse.ArgumentParser, json_name: str) -> None:
    """The replay-and-output flags every serving bench shares (serve, admission)."""
    r = p.add_argument_group("replay and output")
    r.add_argument("--warmup", type=int, default=2, help="short requests sent before each replay")
    r.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    r.add_argument("--out", default=None, help=f"write {json_name} and PNG plots here")


# A CPU-sized shifting day for SmolLM2 on single-thread workers: documents (long prompts, a few
# tokens out), then chat (short prompts, longer answers), then documents again.
PLANNER_PHASES = json.dumps([
    {"name": "prefill", "duration_s": 80, "rate": 1.0, "input_tokens": [300, 500], "output_tokens": [4, 8]},
    {"name": "decode", "duration_s": 80, "rate": 2.4, "input_tokens": [16, 48], "output_tokens": [40, 80]},
    {"name": "prefill", "duration_s": 80, "rate": 1.0, "input_tokens": [300, 500], "output_tokens": [4, 8]},
])
# 43 KV blocks a worker (bf16 SmolLM2: 0.015 GiB), as a GPU's memory bounds its KV: a decode
# worker holds five chat requests (prompt + max_tokens) or one document; the chat phase needs the
# decode pool's KV, the document phase the prefill workers' cores. KV is what admission books
# exactly (a batch-slot limit it does not model would poison its calibration across the shift).
PLANNER_SERVE_ARGS = ("--model smollm2 --dtype bfloat16 --worker-threads 1 --kv-cache-gb 0.015 "
                      "--admission predictive")

def add_planner_compare_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner vs static splits (--planner-compare; bench/planner_bench.py)")
    g.add_argument("--planner-compare", action="store_true",
                   help="replay a shifting trace through every static split of --workers and the planner")
    g.add_argument("--phases", default=PLANNER_PHASES, help="the trace's phases (sim/phases.py: presets or JSON)")
    g.add_argument("--workers", type=int, default=4, help="the worker budget every system gets")
    g.add_argument("--start-split", default="2:2", help="the planner's split at start (P:D)")
    g.add_argument("--planner-serve-args", default=PLANNER_SERVE_ARGS, help="serve flags of every system")



def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="halfmoon bench serve", description=_serve_bench_doc(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, help="a Mooncake trace (JSON lines) to replay")
    src.add_argument("--synthetic", choices=["chat", "conversation", "quoting"], default=None,
                     help="a synthetic workload (the default: chat); conversation: a generated Mooncake "
                          "trace of multi-turn sessions (sim/conversations.py), replayed as a trace; "
                          "quoting: bench/data/quoting_prompts.jsonl in the served model's chat template, "
                          "answers that quote their prompts (bench/spec_serve_bench.py)")
    w.add_argument("--speed", type=float, default=1.0, help="trace: timestamps are divided by this")
    w.add_argument("--max-requests", type=int, default=None, help="trace: replay only the first N")
    w.add_argument("--scale-tokens", type=int, default=512,
                   help="trace: tokens per 512-token trace block (e.g. 64: prompts 1/8 as long, the same "
                        "prefixes shared; a long trace on a CPU)")
    w.add_argument("--rate", type=float, default=1.0, help="synthetic: Poisson arrivals, req/s")
    w.add_argument("--rates", default=None, help="synthetic: a sweep, e.g. 0.5,1,2 (one replay each)")
    w.add_argument("--duration", type=float, default=60.0, help="synthetic: seconds of arrivals")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-input-tokens", type=int, default=None, help="truncate longer prompts")
    w.add_argument("--max-output-tokens", type=int, default=None, help="cap each output")
    c = p.add_argument_group("synthetic conversation trace (--synthetic conversation)")
    c.add_argument("--requests", type=int, default=200, help="requests in the trace")
    c.add_argument("--sessions-per-s", type=float, default=2.0, help="Poisson session starts per second")
    c.add_argument("--turns", default="1,1,2,3,4", help="a session's turn count is drawn from these")
    c.add_argument("--think-s", default="5,30", help="LO,HI: seconds between a session's turns (uniform)")
    c.add_argument("--save-trace", default=None,
                   help="write the generated trace here (replay it with --trace, or `halfmoon sim`)")
    s = p.add_argument_group("SLOs")
    s.add_argument("--ttft-slo-ms", type=float, default=SERVE_SLO.standard_ttft_ms,
                   help="default: serve's standard class (conductor/serve_defaults.py)")
    s.add_argument("--tbt-slo-ms", type=float, default=SERVE_SLO.standard_tbt_ms,
                   help="default: serve's standard class (conductor/serve_defaults.py)")
    s.add_argument("--send-slo", action=argparse.BooleanOptionalAction, default=True,
                   help="send the SLOs with each request (the server may then reject early)")
    s.add_argument("--attainment-target", type=float, default=90.0,
                   help="compare: the baseline 'starts missing' at the first rate below this %%")
    t = p.add_argument_group("targets")
    t.add_argument("--target", default=None, help="an existing server's gRPC HOST:PORT")
    t.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help="flags of the `halfmoon serve` we start")
    t.add_argument("--compare", action="store_true", help="baseline vs cluster, each started by the bench")
    t.add_argument("--baseline-args", default=BASELINE_ARGS, help="compare: the co-located baseline")
    t.add_argument("--cluster-args", default=CLUSTER_ARGS, help="compare: the disaggregated cluster")
    t.add_argument("--speculative-compare", action="store_true",
                   help="with --synthetic quoting: start --cluster-args twice, --speculative off then ngram, "
                        "and report TBT p50 at the first rate and goodput at the last (bench/spec_serve_bench.py)")
    t.add_argument("--defaults-compare", action="store_true",
                   help="start --cluster-args once per precision (fp32, bf16, bf16+int8, bf16+int4), replay "
                        "the same chat workload at each --rates, print goodput against serve's default "
                        "precision (bench/precision_bench.py)")
    t.add_argument("--precisions", default=None,
                   help="--defaults-compare: a subset, e.g. fp32,bf16 (bf16 and serve's default always run)")
    t.add_argument("--otlp-sink", action="store_true",
                   help="receive the started servers' traces here (OTLP/gRPC on 127.0.0.1): appends "
                        "--otlp-endpoint to their flags; with --tracing in them, every span is exported")
    n = p.add_argument_group("cluster-wide prefix hits (bench/prefix_bench.py; all three given: that bench)")
    n.add_argument("--nodes", type=int, default=None, help="Ray nodes started on this machine (head + raylets)")
    n.add_argument("--prefill", type=int, default=None, help="prefill workers, spread over the nodes")
    n.add_argument("--decode", type=int, default=None, help="decode workers, on the head node")
    n.add_argument("--spill", action="store_true",
                   help="instead: serve's default tiers (the host tier the device tier spills to) vs the "
                        "device tier alone, on one node (--prefill/--decode: workers, default 1 each)")
    add_planner_compare_flags(p)
    add_replay_flags(p, "serve_bench.json")
    args = p.parse_args(argv)
    if args.compare and args.target:
        p.error("--compare starts both servers itself; it takes no --target")
    if not 0 < args.scale_tokens <= 512:
        p.error(f"--scale-tokens must be in 1..512, got {args.scale_tokens}")
    if args.speculative_compare:
        from halfmoon.bench.spec_serve_bench import check_args

        if (why := check_args(args)) is not None:
            p.error(why)
    if args.defaults_compare:
        from halfmoon.bench.precision_bench import check_args as check_defaults

        if (why := check_defaults(args)) is not None:
            p.error(why)
    if (args.trace or args.synthetic == "conversation") and args.rates:
        p.error("--rates sweeps the synthetic chat workload; a trace is scaled with --speed")
    if args.synthetic == "conversation":
        try:
            args.shape = conversation_shape(args)
        except ValueError as e:
            p.error(str(e))
    if args.planner_compare and (args.compare or args.target or args.rates or args.prefill or args.decode):
        p.error("--planner-compare starts its own servers on --nodes raylets (default 2): no --compare, "
                "--target, --rates, --prefill or --decode")
    shape = (args.nodes, args.prefill, args.decode)
    if args.spill and (args.nodes is not None or args.compare or args.target or args.rates):
        p.error("--spill starts its own one-node servers: no --nodes, --compare, --target or --rates")
    if any(x is not None for x in shape) and not args.spill and not args.planner_compare and (None in shape or args.compare or args.target
                                                                 or args.rates):
        p.error("--nodes, --prefill and --decode go together (the cluster-wide prefix bench starts its "
                "own servers), without --compare, --target or --rates")
    return args


def workloads(args: argparse.Namespace) -> list[tuple[float | None, Workload]]:
    """(rate, workload) per replay: one per --rates entry, else one (rate None for a trace)."""
    caps = Caps(args.max_input_tokens, args.max_output_tokens)
    if args.synthetic == "conversation" or args.trace:
        path = conversation_file(args) if args.synthetic == "conversation" else args.trace
        return [(None, trace_workload(path, args.speed, caps, args.max_requests, scale_tokens=args.scale_tokens))]
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    if args.synthetic == "quoting":
        from halfmoon.bench.spec_serve_bench import quoting_prompts, quoting_workload, served_model

        prompts = quoting_prompts(served_model(args.baseline_args if args.compare else args.serve_args))
        return [(rate, quoting_workload(rate, args.duration, args.seed, prompts, caps)) for rate in rates]
    return [(rate, chat_workload(rate, args.duration, args.seed, caps)) for rate in rates]


def conversation_shape(args: argparse.Namespace) -> ConversationShape:
    """The --sessions-per-s / --turns / --think-s of a conversation trace (ValueError: bad flag)."""
    try:
        turns = tuple(int(x) for x in args.turns.split(","))
        lo, hi = (float(x) for x in args.think_s.split(","))
    except ValueError:
        raise ValueError(f"--turns takes counts like 1,2,3 and --think-s LO,HI; got {args.turns!r}, "
                         f"{args.think_s!r}") from None
    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    return ConversationShape(args.sessions_per_s, turns, (lo, hi))


def conversation_file(args: argparse.Namespace) -> Path:
    """The generated trace, written to --save-trace (else a temporary file): a file, so the
    replay is the same code path as --trace and the run can be replayed or simulated again."""
    name = f"conversation-{args.requests}req-seed{args.seed}.jsonl"
    path = Path(args.save_trace) if args.save_trace else Path(tempfile.mkdtemp(prefix="halfmoon-trace-")) / name
    return write_trace(conversation_trace(args.requests, args.seed, args.shape), path)


def _serve_bench_doc() -> str | None:
    from halfmoon.bench import serve_bench  # the bench's own description; imported late (it imports us)

    return serve_bench.__doc__
