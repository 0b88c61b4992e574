"""The sampling surface through the APIs (issue 46), with the official openai client and the SDK
over gRPC, against the engine's own results (a second engine on the same weights): logprobs in
chat and completions shape, streaming and not; penalties, logit_bias and min_tokens; clear 400s
naming the field for bad values and what is still not served."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from halfmoon.client import Client
from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from tests.conductor.conftest import MODEL, RunningApi

pytestmark = [pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"


def oai(api: RunningApi) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.http_url + "/v1", api_key="unused", max_retries=0)


def chat_ids(api: RunningApi) -> list[int]:
    tok = api.engine.tokenizer
    return tok.encode(tok.apply_chat_template(MESSAGES))


def test_chat_logprobs_equal_the_engine_streaming_and_not(api: RunningApi, engine: Engine) -> None:
    want = engine.generate([chat_ids(api)], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3))[0]
    client = oai(api)
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = full.choices[0].logprobs.content
    assert len(content) == 8
    tok = api.engine.tokenizer
    for entry, token, lp in zip(content, want.output_ids, want.logprobs):
        assert entry.bytes == list(tok.token_bytes(token))
        assert math.isclose(entry.logprob, lp.logprob, abs_tol=1e-4)
        assert [t.bytes for t in entry.top_logprobs] == [list(tok.token_bytes(i)) for i, _ in lp.top]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True,
                                                 top_logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the second request reuses the first's cached prompt blocks: fp32 rounding, not a difference
    assert len(streamed) == len(content) and all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
                                                 for a, b in zip(streamed, content))
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape(api: RunningApi, engine: Engine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))[0]
    out = oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=2,
                                      extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert [round(x, 4) for x in lp.token_logprobs] == [round(x.logprob, 4) for x in want.logprobs]
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text  # plain ASCII here: the tokens spell the text


def test_penalties_bias_and_min_tokens_equal_the_engine(api: RunningApi, engine: Engine) -> None:
    ids = engine.tokenizer.encode("one two three one two three one two")
    params = SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.3,
                            repetition_penalty=1.1, logit_bias={28: -100.0}, min_tokens=3)
    want = engine.generate([ids], params)[0].text
    got = oai(api).completions.create(model=MODEL, prompt=ids, max_tokens=10, frequency_penalty=1.2,
                                      presence_penalty=0.3, logit_bias={"28": -100},
                                      extra_body={"ignore_eos": True, "repetition_penalty": 1.1, "min_tokens": 3})
    assert got.choices[0].text == want
    with Client(api.grpc_target) as sdk:
        result = sdk.generate(prompt_token_ids=ids, max_tokens=10, ignore_eos=True, frequency_penalty=1.2,
                              presence_penalty=0.3, repetition_penalty=1.1, logit_bias={28: -100.0},
                              min_tokens=3, logprobs=1)
    assert result.text == want and result.logprobs is not None and len(result.logprobs) == 10


@pytest.mark.parametrize(("body", "param"), [
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"presence_penalty": "x"}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"n": 0}, "n"), ({"echo": 1}, "echo"), ({"suffix": "x"}, "suffix"), ({"logit_bias": {"01": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"), ({"prompt": [-1], "echo": True}, "prompt")])
def test_bad_values_are_a_400_naming_the_field(api: RunningApi, body: dict, param: str) -> None:
    answer = httpx.post(api.http_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body},
                        timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_top_logprobs_needs_logprobs(api: RunningApi) -> None:
    answer = httpx.post(api.http_url + "/v1/chat/completions", timeout=30,
                        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "top_logprobs": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "top_logprobs"


def test_metrics_count_the_features_requests_use(api: RunningApi) -> None:
    def count(feature: str) -> float:
        text = httpx.get(api.http_url + "/metrics", timeout=10).text
        line = next(ln for ln in text.splitlines() if ln.startswith(f'halfmoon_request_features_total{{feature="{feature}"}}'))
        return float(line.split()[-1])

    before = {f: count(f) for f in ("logprobs", "penalties", "logit_bias", "min_tokens")}
    oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1, presence_penalty=0.5)
    assert count("logprobs") == before["logprobs"] + 1 and count("penalties") == before["penalties"] + 1
    assert count("logit_bias") == before["logit_bias"] and count("min_tokens") == before["min_tokens"]


def test_echo_with_logprobs_is_what_lm_eval_sends(api: RunningApi, engine: Engine) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt + continuation, max_tokens 1,
    echo, logprobs: every prompt token's logprob (the first null) as transformers-equal as the
    engine's own (tests/engine/test_logprobs.py), then the generated token."""
    ids = engine.tokenizer.encode(PROMPT + " Paris")
    want = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=1))[0]
    out = oai(api).completions.create(model=MODEL, prompt=PROMPT + " Paris", max_tokens=1, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT + " Paris") and choice.text == PROMPT + " Paris" + want.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert want.prompt_logprobs is not None
    got = lp.token_logprobs[1 : len(ids)]
    assert all(math.isclose(a, b.logprob, abs_tol=1e-4) for a, b in zip(got, want.prompt_logprobs))
    streamed = list(oai(api).completions.create(model=MODEL, prompt=PROMPT + " Paris", max_tokens=1, echo=True,
                                                logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    first = next(c for c in streamed if c.choices and c.choices[0].logprobs)
    assert first.choices[0].logprobs.token_logprobs[0] is None
    plain_echo = oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True)
    assert plain_echo.choices[0].text.startswith(PROMPT) and plain_echo.choices[0].logprobs is None


def test_echo_logprobs_keep_the_stop_token(api: RunningApi) -> None:
    """lm_eval scores a continuation as `token_logprobs[ctxlen:-1]`: it counts on exactly one
    entry after the prompt's, also when that one token ends the request (EOS, here forced)."""
    tok = api.engine.tokenizer
    ids = tok.encode(PROMPT + " Paris")
    out = httpx.post(api.http_url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1,
        "logit_bias": {str(tok.eos_id): 100}}).json()["choices"][0]
    lp = out["logprobs"]
    assert out["finish_reason"] == "stop" and len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["tokens"][-1] == tok.token_bytes(tok.eos_id).decode() and lp["token_logprobs"][-2] is not None


def test_grpc_prompt_logprobs(api: RunningApi, engine: Engine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    with Client(api.grpc_target) as sdk:
        result = sdk.generate(PROMPT, max_tokens=2, prompt_logprobs=2)
    assert result.prompt_logprobs is not None and want.prompt_logprobs is not None
    assert [round(x.logprob, 4) for x in result.prompt_logprobs] == [round(x.logprob, 4) for x in want.prompt_logprobs]
    assert all(len(x.top) == 2 for x in result.prompt_logprobs) and result.logprobs is None


def test_halfmoon_client_flags(api: RunningApi, engine: Engine) -> None:
    """`halfmoon client generate` sends the same fields (penalties, a bias, min_tokens, logprobs)."""
    import json
    import os
    import subprocess
    import sys

    ids = engine.tokenizer.encode("one two three one two three")
    params = SamplingParams(max_tokens=6, ignore_eos=True, frequency_penalty=1.0, logit_bias={28: -100.0},
                            min_tokens=2, logprobs=2, prompt_logprobs=1)
    want = engine.generate([ids], params)[0]
    done = subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "client", "generate", "--target", api.grpc_target,
                           "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "6", "--ignore-eos",
                           "--frequency-penalty", "1", "--logit-bias", "28=-100", "--min-tokens", "2",
                           "--logprobs", "2", "--prompt-logprobs", "1", "--json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["token_ids"] == want.output_ids and len(out["logprobs"]) == 6
    assert len(out["prompt_logprobs"]) == len(ids) - 1 and len(out["logprobs"][0]["top"]) == 2
    bad = subprocess.run([sys.executable, "-m", "halfmoon.cli.main", "client", "generate", "hi", "--logit-bias", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "ID=BIAS" in bad.stderr
