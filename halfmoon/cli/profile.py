"""`halfmoon profile`: measure the local engine and write its cost model (JSON) for the router,
admission and simulator."""

from __future__ import annotations

import argparse
import sys


def add_parser(p: argparse.ArgumentParser) -> None:
    from halfmoon.cli.components import PROFILE_ENGINE
    from halfmoon.cli.flags import add_flags

    p.add_argument("--out", default="cost_model.json", help="where to write the cost model")
    p.add_argument("--quick", action="store_true",
                   help="small grid (~10-20 s, what a worker runs at startup); default: full grid (minutes)")
    p.add_argument("--transfer-gbps", type=float, default=None,
                   help="KV fetch bandwidth between workers in GB/s (not measured; default 2, the low "
                        "end of `halfmoon bench transport` on loopback)")
    add_flags(p, PROFILE_ENGINE)  # serve's precision by default: the cost model of what serve runs


def run(args: argparse.Namespace) -> int:
    from halfmoon.conductor.cost_model import DEFAULT_TRANSFER_BYTES_PER_S, CostModel
    from halfmoon.engine.profiling import measure_engine
    from halfmoon.engine.engine import Engine
    from halfmoon.core.errors import ConfigError
    from halfmoon.cli.components import PROFILE_ENGINE
    from halfmoon.cli.flags import build

    bandwidth = DEFAULT_TRANSFER_BYTES_PER_S if args.transfer_gbps is None else args.transfer_gbps * 1e9
    if not bandwidth > 0:
        raise ConfigError(f"--transfer-gbps must be > 0, got {args.transfer_gbps}")
    engine = Engine(build(PROFILE_ENGINE, args))
    try:
        profile = measure_engine(engine, quick=args.quick)
    finally:
        engine.close()
    model = CostModel.from_samples(profile.prefill, profile.decode, transfer_bytes_per_s=bandwidth,
                                   kv_bytes_per_token=profile.kv_bytes_per_token, source=profile.source)
    print_report(profile, model)
    model.save(args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def print_report(profile, model) -> None:  # (Profile, CostModel): imports stay lazy
    """Measured vs fitted at every sampled point, and each fit's largest relative error."""
    from halfmoon.conductor.cost_model import fit_decode, fit_prefill

    print(f"{'prefill':8} {'new':>6} {'cached':>6} {'measured ms':>12} {'fitted ms':>10} {'error':>7}")
    for s in profile.prefill:
        fitted = model.est_prefill_ms(s.n_new, s.n_cached)
        print(f"{'':8} {s.n_new:6d} {s.n_cached:6d} {s.ms:12.1f} {fitted:10.1f} {_err(fitted, s.ms):>7}")
    print(f"{'decode':8} {'batch':>6} {'ctx':>6} {'measured ms':>12} {'fitted ms':>10} {'error':>7}")
    for s in profile.decode:
        fitted = model.est_decode_step_ms(s.batch, s.context_tokens)
        print(f"{'':8} {s.batch:6d} {s.context_tokens:6d} {s.ms:12.1f} {fitted:10.1f} {_err(fitted, s.ms):>7}")
    pre, dec = fit_prefill(profile.prefill), fit_decode(profile.decode)
    print(f"prefill_ms = {_poly(pre.coef, ('', 'n', 'n*c', 'n^2'))}   (max error {pre.max_rel_error:.1%})")
    print(f"decode_step_ms = {_poly(dec.coef, ('', 'b', 'k'))}   (max error {dec.max_rel_error:.1%})")
    print(f"transfer: {model.transfer_bytes_per_s / 1e9:.2f} GB/s, {model.kv_bytes_per_token} KV bytes/token "
          f"-> {model.est_transfer_ms(1024):.1f} ms per 1024 tokens")
    print(speculation_line(profile))


SPECULATION_ACCEPTANCES = (0.6, 0.8)  # the policy's prior, and a quoting workload's (bench engine --speculative)


def speculation_line(profile) -> str:  # (Profile) -> str
    """Speculative decoding's crossover on this machine: from the decode steps whose requests
    hold the shortest context, the batch above which verifying k drafted tokens per request costs more than it
    saves (engine/speculative.py StepCostTable; the engine keeps measuring its own steps)."""
    from halfmoon.engine.speculative import SpeculativeConfig, StepCostTable

    if not profile.decode:
        return "speculation crossover: no decode steps measured"
    per_request = min(s.context_tokens // s.batch for s in profile.decode)  # context_tokens: the batch's
    steps = {s.batch: s.ms / 1e3 for s in profile.decode if s.context_tokens // s.batch == per_request}
    table = StepCostTable.from_steps(SpeculativeConfig(mode="ngram"), steps)
    top = max(steps)
    parts = []
    for a in SPECULATION_ACCEPTANCES:
        crossover = table.measured_crossover(a)
        parts.append(f"acceptance {a:.0%}: " + (f"pays up to batch {crossover}" if crossover is not None
                                                else f"pays at every batch measured (<= {top // 2})"))
    return ("speculation crossover (--speculative-max-batch; 0 = the engine measures its own): "
            + "; ".join(parts))


def _err(fitted: float, measured: float) -> str:
    return f"{(fitted - measured) / measured:+.1%}"


def _poly(coef: tuple[float, ...], terms: tuple[str, ...]) -> str:
    return " + ".join(f"{a:.4g}{'*' + t if t else ''}" for a, t in zip(coef, terms, strict=True))
