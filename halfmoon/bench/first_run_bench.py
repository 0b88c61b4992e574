"""`halfmoon bench first-run`: what a new user waits for on a fresh machine, from `halfmoon serve`
to the first answer, with an EMPTY cache folder (nothing profiled, no model assembled, no weights
kept), against the same start once that folder is warm (the baseline, same run).

Each variant (`--variant 'ARGS'`, repeatable; default: serve's defaults) starts `halfmoon serve
ARGS --grpc-port 0 --http-port 0` twice with one fresh `HALFMOON_CACHE_DIR`: cold, then warm.
Per start: seconds to "listening", to the first chat answer (one request, 8 tokens), and from
the server's own log the model's assembly and the profile's duration. The profile's target: at
most 60 s on 2 cores (issue 45). The install (`make setup`) is timed by deploy/install.sh itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILE_TARGET_S = 60.0
START_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class Start:
    """One `halfmoon serve` start, in seconds from the command (None: not seen in its log)."""

    variant: str
    cache: str  # "cold" | "warm"
    listening_s: float
    first_answer_s: float
    profile_s: float | None
    assemble_s: float | None


def _wait_listening(proc: subprocess.Popen[str], log: Path, started: float) -> tuple[str, float]:
    while time.monotonic() - started < START_TIMEOUT_S:
        match = re.search(r"listening grpc=\S+ http=(\S+)", log.read_text())
        if match:
            return match.group(1), time.monotonic() - started
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited ({proc.returncode}): {log.read_text()[-2000:]}")
        time.sleep(0.2)  # poll interval of a bounded wait
    raise TimeoutError(f"serve did not listen within {START_TIMEOUT_S:.0f} s")


def _chat(http: str, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8})
    req = urllib.request.Request(http + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        answer = json.loads(resp.read())
    if not answer["choices"][0]["message"]["content"]:
        raise RuntimeError(f"an empty answer: {answer}")


def _seconds(pattern: str, text: str) -> float | None:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else None


def start_once(variant: str, cache: Path, label: str, workdir: Path) -> Start:
    log = workdir / f"serve-{label}.log"
    args = shlex.split(variant)
    model = args[args.index("--model") + 1] if "--model" in args else "smollm2"
    env = {**os.environ, "HALFMOON_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "halfmoon.cli.main", "serve", *args, "--grpc-port", "0",
                                 "--http-port", "0"], stdout=out, stderr=out, text=True, start_new_session=True,
                                env=env)
    try:
        http, listening = _wait_listening(proc, log, started)
        _chat(http, model)
        first = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
    text = log.read_text()
    return Start(variant or "(defaults)", label, round(listening, 1), round(first, 1),
                 _seconds(r"profiled in ([\d.]+) s", text), _seconds(r"assembled \S+ in ([\d.]+) s", text))


def run_variant(variant: str, workdir: Path) -> list[Start]:
    cache = Path(tempfile.mkdtemp(prefix="halfmoon-first-run-", dir=workdir))
    return [start_once(variant, cache, label, workdir) for label in ("cold", "warm")]


def render(rows: list[Start]) -> str:
    lines = ["| serve args | cache | listening s | first answer s | profile s (target <= 60) | model assembly s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        profile = "-" if r.profile_s is None else f"{r.profile_s:.1f}" + (" MISSED" if r.profile_s > PROFILE_TARGET_S else "")
        assemble = "-" if r.assemble_s is None else f"{r.assemble_s:.1f}"
        lines.append(f"| {r.variant} | {r.cache} | {r.listening_s:.1f} | {r.first_answer_s:.1f} | {profile} | {assemble} |")
    by = {(r.variant, r.cache): r for r in rows}
    for variant in dict.fromkeys(r.variant for r in rows):
        cold, warm = by[(variant, "cold")], by[(variant, "warm")]
        lines.append(f"{variant}: first run {cold.first_answer_s:.1f} s to the first answer, "
                     f"{cold.first_answer_s / warm.first_answer_s:.2f}x a warm start ({warm.first_answer_s:.1f} s)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="halfmoon bench first-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=None,
                   help="`halfmoon serve` arguments of one variant (repeatable; default: none, serve's defaults)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="halfmoon-bench-first-run-") as tmp:
        rows = [row for variant in (args.variant or [""]) for row in run_variant(variant, Path(tmp))]
    print(json.dumps([asdict(r) for r in rows], indent=1) if args.json else render(rows))
    missed = [r for r in rows if r.profile_s is not None and r.profile_s > PROFILE_TARGET_S]
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
