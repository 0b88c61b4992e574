"""`python -m halfmoon.bench.make_trace` (or `halfmoon bench make-trace`): write a synthetic chat trace in the
Mooncake format (sim/conversations.py: multi-turn sessions over a few shared system prompts,
Poisson session starts, think time between turns).

The bundled bench/data/sample_trace.jsonl is this command's output at its defaults
(tests/bench/test_make_trace.py checks it byte for byte):

    python -m halfmoon.bench.make_trace --requests 147 --seed 7 --sessions-per-s 0.5 --out bench/data/sample_trace.jsonl

A day whose mix shifts (issue 49's planner): `--phases prefill:600,decode:600,prefill:600` (or a
JSON list; sim/phases.py: each phase its own rate, prompt and output lengths and duration, Poisson
arrivals, no shared prefix), `--phase-scale 8` multiplying every rate (the presets load 8 H100s).

Other shapes: more requests (`--requests 886 --seed 11`: BENCHMARKS.md's synth400.jsonl), denser
sessions, other turn counts or think times. Replay one with `halfmoon bench serve --trace FILE`
or `halfmoon sim --trace FILE`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from halfmoon.bench.serve_args import conversation_shape
from halfmoon.sim.conversations import conversation_trace, trace_text, write_trace
from halfmoon.sim.phases import parse_phases, phased_trace

SAMPLE_REQUESTS, SAMPLE_SEED, SAMPLE_SESSIONS_PER_S = 147, 7, 0.5  # bench/data/sample_trace.jsonl


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m halfmoon.bench.make_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=SAMPLE_REQUESTS, help="requests in the trace")
    p.add_argument("--seed", type=int, default=SAMPLE_SEED)
    p.add_argument("--sessions-per-s", type=float, default=SAMPLE_SESSIONS_PER_S,
                   help="Poisson session starts per second")
    p.add_argument("--turns", default="1,1,2,3,4", help="a session's turn count is drawn from these")
    p.add_argument("--think-s", default="5,30", help="LO,HI: seconds between a session's turns (uniform)")
    p.add_argument("--adapters", type=int, default=0,
                   help="spread sessions over this many LoRA adapters (an `adapter` key per request; 0: none)")
    p.add_argument("--adapter-skew", type=float, default=1.0, help="Zipf exponent of the adapters' popularity")
    p.add_argument("--phases", default=None,
                   help="NAME:SECONDS[:RATE],... (presets: prefill, decode, mixed) or a JSON list of phases: a "
                        "day whose mix shifts instead of conversations (sim/phases.py; --requests is ignored)")
    p.add_argument("--phase-scale", type=float, default=1.0, help="multiply every phase's rate")
    p.add_argument("--out", default=None, help="the JSONL file to write (default: stdout)")
    args = p.parse_args(argv)
    if args.phases is not None:
        try:
            args.phase_list = parse_phases(args.phases, args.phase_scale)
        except ValueError as e:
            p.error(str(e))
    try:
        args.shape = conversation_shape(args)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phases is not None:
        rows = phased_trace(args.phase_list, args.seed)
    else:
        rows = conversation_trace(args.requests, args.seed, args.shape, args.adapters, args.adapter_skew)
    if args.out is None:
        sys.stdout.write(trace_text(rows))
    else:
        write_trace(rows, args.out)
        span = rows[-1]["timestamp"] / 1e3 if rows else 0.0
        print(f"{args.out}: {len(rows)} requests over {span:g} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
