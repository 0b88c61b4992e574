"""Bad input gets a clear error naming what is wrong, never a crash or a hang.

Model files: unknown path, not a GGUF, corrupt and truncated GGUF -> ModelLoadError.
Requests: each bad field -> InvalidRequestError whose `.field` names it; nothing is queued.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.core.errors import ConfigError, InvalidRequestError
from halfmoon.engine.errors import ModelLoadError
from halfmoon.core.params import FinishReason
from halfmoon.core.params import SamplingParams
from tests.conftest import EngineFactory, assert_engine_idle

pytestmark = pytest.mark.timeout(120)

PROMPT = [504, 3458, 282, 4649]  # "The capital of France"


def load(model: str) -> Engine:
    return Engine(EngineConfig(model=model, num_blocks=4))


# ---------------------------------------------------------------- model files


@pytest.mark.timeout(30)
def test_unknown_model_path_says_what_was_tried(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelLoadError) as err:
        load(str(missing))
    message = str(err.value)
    assert str(missing) in message
    assert "tried" in message and "smollm2" in message and "config.json" in message


@pytest.mark.timeout(30)
def test_folder_without_config_json_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tried"):
        load(str(tmp_path))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("content", [b"", b"GG", b"hello, I am a text file\n" * 20],
                         ids=["empty", "two-bytes", "text"])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load(str(path))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", [None, 3], ids=["random-version", "version-3"])
def test_corrupt_gguf(tmp_path: Path, version: int | None) -> None:
    body = random.Random(7).randbytes(1 << 20)
    if version is not None:  # a valid header version, so the reader goes on to parse garbage
        body = version.to_bytes(4, "little") + body
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + body)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load(str(path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.99])
def test_truncated_gguf(tmp_path: Path, gguf_path: Path, fraction: float) -> None:
    size = gguf_path.stat().st_size
    path = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as src:
        path.write_bytes(src.read(int(size * fraction)))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load(str(path))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs", [{"dtype": "float64"}, {"block_size": 0}, {"num_blocks": 0},
                                    {"kv_cache_gb": 0}, {"max_num_seqs": -1},
                                    {"max_model_len": 1}, {"num_threads": 0}])
def test_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- requests


def rejects(engine: Engine, prompt: list[int], params: SamplingParams, field: str) -> str:
    """Assert add_request and generate both raise for `field` and queue nothing; the message."""
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt, params)
    assert err.value.field == field
    with pytest.raises(InvalidRequestError) as err_generate:
        engine.generate([PROMPT, prompt], params)  # all or nothing: the good prompt never runs
    assert err_generate.value.field == field
    assert not engine.has_unfinished()
    assert str(err.value).startswith(f"{field}: ")
    return err.value.message


@pytest.mark.timeout(30)
def test_empty_prompt(engine: Engine) -> None:
    assert "empty" in rejects(engine, [], SamplingParams(), "prompt")


@pytest.mark.timeout(30)
def test_prompt_longer_than_context(engine: Engine) -> None:
    n = engine.max_model_len
    message = rejects(engine, [PROMPT[0]] * n, SamplingParams(max_tokens=1), "prompt")
    assert str(n) in message
    rejects(engine, [PROMPT[0]] * (n + 100), SamplingParams(max_tokens=1), "prompt")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_not_positive(engine: Engine, max_tokens: int) -> None:
    rejects(engine, PROMPT, SamplingParams(max_tokens=max_tokens), "max_tokens")


@pytest.mark.timeout(30)
def test_max_tokens_beyond_context(engine: Engine) -> None:
    fits = engine.max_model_len - len(PROMPT)
    message = rejects(engine, PROMPT, SamplingParams(max_tokens=fits + 1), "max_tokens")
    assert "context" in message and str(fits) in message


@pytest.mark.timeout(30)
def test_max_tokens_beyond_kv_cache(engine: Engine) -> None:
    capacity = engine.pool.num_blocks * engine.config.block_size
    assert capacity < engine.max_model_len  # the shared engine has a small cache
    message = rejects(engine, PROMPT, SamplingParams(max_tokens=capacity), "max_tokens")
    assert "KV cache" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("temperature", [-0.5, float("nan")])
def test_negative_temperature(engine: Engine, temperature: float) -> None:
    rejects(engine, PROMPT, SamplingParams(temperature=temperature), "temperature")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5])
def test_top_p_outside_unit_interval(engine: Engine, top_p: float) -> None:
    rejects(engine, PROMPT, SamplingParams(temperature=1.0, top_p=top_p), "top_p")


@pytest.mark.timeout(30)
def test_negative_top_k(engine: Engine) -> None:
    rejects(engine, PROMPT, SamplingParams(temperature=1.0, top_k=-1), "top_k")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad_id", [-1, 49152, 10**9], ids=["negative", "vocab", "huge"])
def test_prompt_ids_outside_vocabulary(engine: Engine, bad_id: int) -> None:
    assert engine.model_config.vocab_size == 49152
    message = rejects(engine, [*PROMPT, bad_id], SamplingParams(), "prompt_ids")
    assert str(bad_id) in message


@pytest.mark.timeout(30)
def test_stop_token_ids_outside_vocabulary(engine: Engine) -> None:
    rejects(engine, PROMPT, SamplingParams(stop_token_ids=(49152,)), "stop_token_ids")


@pytest.mark.timeout(30)
def test_empty_stop_string(engine: Engine) -> None:
    rejects(engine, PROMPT, SamplingParams(stop=("",)), "stop")


@pytest.mark.timeout(60)
def test_duplicate_request_id(make_engine: EngineFactory) -> None:
    # Its own engine: today the duplicate is accepted and wedges the engine for good.
    engine = make_engine(num_blocks=16)
    engine.add_request(PROMPT, SamplingParams(max_tokens=3), request_id="same")
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(PROMPT, SamplingParams(max_tokens=5), request_id="same")
    assert err.value.field == "request_id"
    finished = [out for _ in range(5) for out in engine.step() if out.finished]
    assert [(o.request_id, o.end.finish_reason) for o in finished] == [("same", FinishReason.LENGTH)]
    assert_engine_idle(engine)


@pytest.mark.timeout(30)
def test_params_list_must_match_prompts(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engine.generate([PROMPT, PROMPT], [SamplingParams()])
    assert err.value.field == "params"


@pytest.mark.timeout(60)
def test_engine_still_serves_after_rejections(engine: Engine) -> None:
    for params in (SamplingParams(top_p=0.0), SamplingParams(max_tokens=0)):
        with pytest.raises(InvalidRequestError):
            engine.add_request(PROMPT, params)
    [result] = engine.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(result.output_ids) == 2
