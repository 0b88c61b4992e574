"""A client's request id: taken while its request runs, free the moment its stream closes.

An engine frees a cancelled request at its next step; a client retrying at once under the same id
(retry loops, Schemathesis) must neither be refused nor meet the old request's last output. Both
backends name each try inside the engines `{id}@{n}` (conductor/request_names.py).
"""

from __future__ import annotations

import httpx
import pytest

from halfmoon.conductor.backend import GenerationInput
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.params import FinishReason, SamplingParams
from halfmoon.engine.engine import Engine
from tests.conductor.conftest import MODEL, RunningApi

PROMPT = "Write a short poem about the sea."


def test_a_running_id_is_refused_and_free_once_its_stream_ends(api: RunningApi) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True,
            "request_id": "same-id"}
    with httpx.stream("POST", api.http_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # held: dropping it would close the stream
        assert next(lines).startswith("data: ")
        second = httpx.post(api.http_url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert second.status_code == 400, second.text
    assert second.json()["error"]["param"] == "request_id" and "already in use" in second.json()["error"]["message"]
    assert api.wait_idle() == []
    again = httpx.post(api.http_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["completion_tokens"] == 3


def test_an_id_is_reused_at_once_after_a_cancel(api: RunningApi, engine: Engine) -> None:
    """Closed after two chunks, then the same id again before the engine took the abort: the
    second request runs whole and is exactly the engine's, with the client's id on every chunk."""
    prompt = engine.tokenizer.encode(PROMPT)
    long, short = SamplingParams(max_tokens=300, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)
    want = engine.generate([prompt], short)[0].output_ids

    async def cancel_then_reuse() -> tuple[list[int], list[str], FinishReason | None]:
        first = api.backend.generate(GenerationInput(prompt, long, request_id="retry"))
        await anext(first)
        await anext(first)
        await first.aclose()  # type: ignore[attr-defined]
        chunks = [c async for c in api.backend.generate(GenerationInput(prompt, short, request_id="retry"))]
        end = chunks[-1].end
        return ([t for c in chunks for t in c.token_ids], [c.request_id for c in chunks],
                None if end is None else end.finish_reason)

    got, ids, reason = api.call(cancel_then_reuse())
    assert (got, reason) == (want, FinishReason.LENGTH)
    assert set(ids) == {"retry"}
    assert api.wait_idle() == []


def test_the_backend_refuses_a_duplicate_while_the_first_runs(api: RunningApi) -> None:
    async def duplicate() -> str:
        first = api.backend.generate(GenerationInput([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True),
                                                     request_id="twice"))
        await anext(first)
        try:
            with pytest.raises(InvalidRequestError) as refused:
                await anext(api.backend.generate(GenerationInput([5, 6, 7], SamplingParams(max_tokens=2),
                                                                 request_id="twice")))
            return str(refused.value)
        finally:
            await first.aclose()  # type: ignore[attr-defined]

    assert "'twice' is already in use" in api.call(duplicate())
    assert api.wait_idle() == []
