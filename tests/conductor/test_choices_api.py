"""n > 1 through the OpenAI API with the official client (issue 46): choices from one prefill,
in order, each equal to the engine's own choice (a second engine on the same weights); streaming
interleaves them by `index`; usage sums their tokens; echo starts every choice."""

from __future__ import annotations

from collections import defaultdict

import openai
import pytest

from halfmoon.core.params import SamplingParams
from halfmoon.engine.engine import Engine
from tests.conductor.conftest import MODEL, RunningApi

pytestmark = [pytest.mark.slow]
PROMPT = "Once upon a time, in a village by the sea, there lived"


def oai(api: RunningApi) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.http_url + "/v1", api_key="unused", max_retries=0)


def test_seeded_completions_choices_equal_the_engine(api: RunningApi, engine: Engine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=4, ignore_eos=True, logprobs=1)
    want = engine.generate_choices(ids, params)
    before = api.engine.scheduler.stats.prompt_tokens_computed
    out = oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=11, n=4,
                                      logprobs=1, extra_body={"ignore_eos": True})
    assert api.engine.scheduler.stats.prompt_tokens_computed - before <= len(ids), "the prompt was computed once"
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [w.text for w in want]
    assert all(len(c.logprobs.token_logprobs) == 8 and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 32 and out.usage.prompt_tokens == len(ids)
    again = oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=11, n=4,
                                        extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


def test_greedy_chat_choices_are_copies_streaming_and_not(api: RunningApi) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    client = oai(api)
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    three = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=3)
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, n=3, stream=True,
                                            stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert dict(texts) == {i: one.choices[0].message.content for i in range(3)}
    assert set(finishes) == {0, 1, 2} and usage is not None and usage.completion_tokens == three.usage.completion_tokens


def test_echo_starts_every_choice(api: RunningApi) -> None:
    out = oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, echo=True, logprobs=0)
    for c in out.choices:
        assert c.text.startswith(PROMPT)
        assert c.logprobs.token_logprobs[0] is None  # the prompt's first token has none


def test_n_out_of_range_is_a_400_naming_it(api: RunningApi) -> None:
    for n in (0, 65):
        with pytest.raises(openai.BadRequestError) as e:
            oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=n)
        assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        oai(api).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, best_of=3)
    assert e.value.body["param"] == "best_of"


def test_sdk_choices_over_grpc(api: RunningApi, engine: Engine) -> None:
    from halfmoon.client import Client

    ids = engine.tokenizer.encode(PROMPT)
    want = engine.generate_choices(ids, SamplingParams(max_tokens=5, temperature=0.7, seed=5, n=3, ignore_eos=True))
    with Client(api.grpc_target) as sdk:
        result = sdk.generate(PROMPT, max_tokens=5, temperature=0.7, seed=5, n=3, ignore_eos=True)
        streamed: dict[int, list[int]] = defaultdict(list)
        for chunk in sdk.stream(PROMPT, max_tokens=5, temperature=0.7, seed=5, n=3, ignore_eos=True):
            streamed[chunk.index] += chunk.token_ids
    assert [c.token_ids for c in result.choices] == [w.output_ids for w in want]
    assert result.token_ids == want[0].output_ids and result.usage.completion_tokens == 15
    assert all(c.finish_reason == "length" and c.usage.completion_tokens == 5 for c in result.choices)
    assert dict(streamed) == {i: w.output_ids for i, w in enumerate(want)}
