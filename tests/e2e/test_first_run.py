"""What a new user runs first, on a fresh machine (issue 45): `make serve` from an EMPTY cache
folder — nothing profiled, no model assembled, no weights kept — with the defaults only, then the
README's quick-start commands against it and an answer from the official openai client. The
cluster (serve's default), `--colocated`, and `--model gemma3-270m`; and `--dtype float32`, what
`--dtype auto` picks on an AVX2-only machine (bf16 where oneDNN has its bf16 path), so both
precisions are profiled from scratch on any machine the suite runs on.

A warm ~/.cache once hid a `make serve` that exited at its start-up profile on every new machine:
these tests start from a folder of their own, never the session's shared one.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.support import wait_for_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
START_TIMEOUT_S = 600  # a first start profiles the workers (about a minute on 2 cores)


def quick_start_commands() -> list[str]:
    """The README's quick-start block after `make serve`: the commands 'from another terminal'."""
    text = README.read_text()
    block = text.split("from another terminal", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        current += line.rstrip("\\").strip() + " " if line.strip() else ""
        if current and not line.rstrip().endswith("\\"):
            commands.append(current.strip())
            current = ""
    return commands


def test_the_readme_quick_start_is_what_this_test_runs() -> None:
    commands = quick_start_commands()
    assert len(commands) == 2 and commands[0].startswith("curl ") and "halfmoon client chat" in commands[1]


class FirstRun:
    """`make serve ARGS=...` from an empty cache folder, its log, and when it first answered."""

    def __init__(self, tmp: Path, args: str) -> None:
        self.cache = tmp / "empty-cache"
        self.cache.mkdir()
        self.log = tmp / "serve.log"
        env = {**os.environ, "HALFMOON_CACHE_DIR": str(self.cache), "PYTHONUNBUFFERED": "1"}
        self.started = time.monotonic()
        with open(self.log, "w") as out:  # its own session: stopped as a terminal's Ctrl-C would
            self.proc = subprocess.Popen(["make", "--no-print-directory", "serve", f"ARGS={args}"], cwd=ROOT,
                                         stdout=out, stderr=out, text=True, start_new_session=True, env=env)

    def wait_listening(self) -> tuple[str, str]:
        match = wait_for_log(self.proc, self.log, r"listening grpc=(\S+) http=(\S+)", timeout=START_TIMEOUT_S)
        return match.group(1), match.group(2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _serve_from_scratch(tmp: Path, args: str, model: str) -> str:
    """Start, answer one chat request with the openai client; the log (for the assertions)."""
    run = FirstRun(tmp, args)
    try:
        _, http = run.wait_listening()
        client = openai.OpenAI(base_url=http + "/v1", api_key="none", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8)
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        first_token_s = time.monotonic() - run.started
        log = run.log.read_text()
        print(f"first run of `make serve ARGS={args}`: first answer {first_token_s:.1f} s after the start")
        return log
    finally:
        run.stop()


def _profiled_from_scratch(log: str) -> None:
    """The start measured its profile (no cache to read) and said what it did and how long."""
    assert "none cached" in log and re.search(r"profiled in [\d.]+ s", log), log[-3000:]
    assert "profile" in log and "Traceback" not in log, log[-3000:]


def test_make_serve_defaults_answers_from_an_empty_cache(tmp_path: Path) -> None:
    """The README's first command, cluster defaults, then the README's quick-start commands."""
    run = FirstRun(tmp_path, "")
    try:
        grpc_target, http = run.wait_listening()
        assert (grpc_target, http) == ("127.0.0.1:50051", "http://127.0.0.1:8000"), "not the README's ports"
        for command in quick_start_commands():
            done = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0 and done.stdout.strip(), (command, done.stdout, done.stderr)
            if command.startswith("curl"):
                assert '"choices"' in done.stdout and '"content"' in done.stdout, done.stdout
        client = openai.OpenAI(base_url=http + "/v1", api_key="none", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8)
        assert chat.choices[0].message.content
        _profiled_from_scratch(run.log.read_text())
        assert "starting 1 prefill + 1 decode workers" in run.log.read_text()
    finally:
        run.stop()


@pytest.mark.parametrize("args", ["--colocated", pytest.param("--dtype float32", marks=pytest.mark.long)])
def test_make_serve_variants_answer_from_an_empty_cache(tmp_path: Path, args: str) -> None:
    _profiled_from_scratch(_serve_from_scratch(tmp_path, args, "smollm2"))


@pytest.mark.long
def test_make_serve_gemma3_answers_from_an_empty_cache(tmp_path: Path) -> None:
    log = _serve_from_scratch(tmp_path, "--model gemma3-270m", "gemma3-270m")
    _profiled_from_scratch(log)
    assert "assembling it from" in log and re.search(r"assembled gemma3-270m in [\d.]+ s", log), log[-3000:]
