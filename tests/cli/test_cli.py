"""The `halfmoon` command (cli/) as a user runs it: real processes, the real model, exit codes, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from halfmoon.conductor.serve_defaults import EXACT_FLAGS
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import auto_dtype
from halfmoon.engine.engine import Engine
from tests.waiting import poll

PROMPT = "The capital of France is"
CLI = [sys.executable, "-m", "halfmoon.cli.main"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_generate_json_matches_the_engine(engine: Engine) -> None:
    proc = run_cli("generate", "--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos", "--json",
                   "--threads", "1", *EXACT_FLAGS)  # token-exact: the engine fixture is fp32
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"prompt_ids", "output_ids", "text", "finish_reason", "ttft_ms", "tpot_ms", "logprobs",
                        "prompt_logprobs"}
    ids = engine.tokenizer.encode(PROMPT)
    assert out["prompt_ids"] == ids
    expected = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out["output_ids"] == expected.output_ids
    assert out["text"] == expected.text
    assert out["finish_reason"] == "length"
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0


def test_generate_sampling_flags_and_n(engine: Engine) -> None:
    """`halfmoon generate` takes the penalties, a bias, logprobs and n as `halfmoon client` does."""
    proc = run_cli("generate", "--prompt", PROMPT, "--max-tokens", "5", "--ignore-eos", "--json", "--threads", "1",
                   "--temperature", "0.8", "--seed", "3", "--n", "2", "--frequency-penalty", "0.5",
                   "--logit-bias", "28=-100", "--logprobs", "1", *EXACT_FLAGS)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate_choices(ids, SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, seed=3, n=2,
                                                       frequency_penalty=0.5, logit_bias={28: -100.0}, logprobs=1))
    assert [c["output_ids"] for c in out["choices"]] == [w.output_ids for w in want]
    assert out["output_ids"] == want[0].output_ids and len(out["choices"][1]["logprobs"]) == 5


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["--prompt", "hi", "--n", "0"], "n"),
        (["--prompt-ids", "1,x,3"], "prompt_ids"),
        (["--prompt-ids", "1,99999999"], "vocabulary"),
        (["--prompt", "hi", "--model", "/no/such/model.gguf"], "tried"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args: list[str], needle: str) -> None:
    proc = run_cli("generate", *args, "--threads", "1")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "halfmoon: error:" in proc.stderr and needle in proc.stderr
    assert "Traceback" not in proc.stderr


def _wait_for_url(proc: subprocess.Popen[str], log: Path, timeout: float = 120) -> str:
    """The HTTP URL of the server's `listening` line; fails the test if it exits first."""

    def listening() -> re.Match[str] | None:
        match = re.search(r"listening grpc=\S+ http=(http://\S+)", log.read_text())
        if not match and proc.poll() is not None:
            pytest.fail(f"serve exited early ({proc.returncode}): {log.read_text()}")
        return match

    match = poll(listening, timeout)
    if not match:
        pytest.fail(f"serve did not come up in {timeout}s: {log.read_text()}")
    return match.group(1)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_serve_answers_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([*CLI, "serve", "--colocated", "--grpc-port", "0", "--http-port", "0",
                                 "--threads", "1"], stdout=err,
                                stderr=err, text=True, env=ENV)
    try:
        url = _wait_for_url(proc, log)
        # no --dtype: serve says what `auto` chose on this machine and why, and how to ask for exact
        assert f"precision {auto_dtype('cpu')[0]}, quantization none (--dtype auto: " in log.read_text()
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}
        out = _post(url + "/v1/completions", {"model": "smollm2", "prompt": PROMPT, "max_tokens": 5,
                                              "ignore_eos": True})
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"
        with pytest.raises(urllib.error.HTTPError) as bad:
            _post(url + "/v1/completions", {"model": "smollm2", "prompt": PROMPT, "temperature": -1})
        assert bad.value.code == 400
        assert json.loads(bad.value.read())["error"]["param"] == "temperature"
        redis_port = int(re.search(r"embedded Redis \(block index\) at redis://127.0.0.1:(\d+)",
                                   log.read_text()).group(1))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "shutting down" in log.read_text() and "halfmoon: stopped" in log.read_text()
        with pytest.raises(OSError):  # the embedded redis-server went down with us: no orphan
            socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_warns_when_bound_beyond_localhost(capsys: pytest.CaptureFixture[str]) -> None:
    from halfmoon.api.server import Endpoints, ServerConfig
    from halfmoon.cli.serve import announce

    announce(Endpoints("127.0.0.1", 50051, 8000, False, False), "smollm2", ServerConfig())
    assert "WARNING" not in capsys.readouterr().err
    announce(Endpoints("0.0.0.0", 50051, 8000, False, True), "smollm2", ServerConfig(host="0.0.0.0"))
    err = capsys.readouterr().err
    assert "WARNING: listening on 0.0.0.0 without TLS" in err
    assert "listening grpc=0.0.0.0:50051 http=http://0.0.0.0:8000 model=smollm2" in err
    announce(Endpoints("0.0.0.0", 1, 2, True, True), "smollm2", ServerConfig(host="0.0.0.0"))
    assert "WARNING" not in capsys.readouterr().err


def test_serve_takes_tiers_and_index_with_tensor_parallel_workers() -> None:
    """Tiers and the block index under tp are built (no refusal left): the cluster's config
    takes them, as the engine's does."""
    from halfmoon.conductor.cluster_config import ClusterConfig
    from halfmoon.engine.config import EngineConfig

    engine = EngineConfig(tp=2, host_cache_gb=1.0, redis_url="redis://localhost:6379/0")
    config = ClusterConfig(prefill_tp=2, decode_tp=2, engine=engine)
    assert config.tp("decode") == 2 and config.engine.host_cache_gb == 1.0
