"""Cost model: exact fits, JSON contract, one real quick profile, and `halfmoon profile`."""

from __future__ import annotations

import pickle

import itertools
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from halfmoon.conductor.serve_defaults import serve_engine
from halfmoon.conductor.cost_model import (DECODE_TERMS, PREFILL_TERMS, CostModel, FitError, fit_decode, fit_prefill,
                                  fit_profile, profile_engine)
from halfmoon.engine.engine import Engine
from halfmoon.core.errors import ConfigError
from halfmoon.core.messages import DecodeSample, PrefillSample
from halfmoon.engine.profiling import ProfileError, ProfileGrid, measure_engine
from halfmoon.core.params import SamplingParams
from tests.conftest import EngineFactory, assert_engine_idle

PREFILL_TRUE = (25.0, 1.8, 0.0004, 0.0015)
DECODE_TRUE = (40.0, 0.7, 0.003)
MODEL = CostModel(PREFILL_TRUE, DECODE_TRUE, transfer_bytes_per_s=2e9, kv_bytes_per_token=46080,
                  source="test")


def prefill_samples(coef: tuple[float, ...]) -> list[PrefillSample]:
    a, b, c, d = coef
    return [PrefillSample(n, k, a + b * n + c * n * k + d * n * n)
            for n, k in itertools.product((16, 64, 256, 1024), (0, 256, 2048))]


def decode_samples(coef: tuple[float, ...]) -> list[DecodeSample]:
    a, b, c = coef
    return [DecodeSample(bs, k, a + b * bs + c * k)
            for bs, k in itertools.product((1, 4, 16, 64), (100, 5000, 40000))]


def test_fits_recover_known_polynomials() -> None:
    pre, dec = fit_prefill(prefill_samples(PREFILL_TRUE)), fit_decode(decode_samples(DECODE_TRUE))
    assert pre.coef == pytest.approx(PREFILL_TRUE, rel=1e-6, abs=1e-9)
    assert dec.coef == pytest.approx(DECODE_TRUE, rel=1e-6, abs=1e-9)
    assert pre.max_rel_error < 1e-6 and dec.max_rel_error < 1e-6


def test_a_zero_term_is_recovered_as_zero() -> None:
    pre = fit_prefill(prefill_samples((10.0, 2.0, 0.0, 0.0)))
    assert pre.coef == pytest.approx((10.0, 2.0, 0.0, 0.0), rel=1e-6, abs=1e-9)


def test_noisy_decreasing_samples_still_give_non_negative_monotone_predictions() -> None:
    """Unconstrained least squares would give a negative batch slope here (batch 4 measured
    faster than batch 1, as SmolLM2 on one thread does); the fit keeps every term >= 0."""
    samples = [DecodeSample(1, 100, 46.0), DecodeSample(4, 400, 38.0), DecodeSample(8, 800, 37.0),
               DecodeSample(1, 1000, 47.0), DecodeSample(8, 8000, 60.0)]
    fit = fit_decode(samples)
    assert all(a >= 0 for a in fit.coef)
    model = CostModel(PREFILL_TRUE, fit.coef, 1e9, 1)
    grid = [model.est_decode_step_ms(b, k) for b in (1, 2, 8, 64) for k in (0, 100, 10_000)]
    assert min(grid) >= 0
    assert model.est_decode_step_ms(8, 800) >= model.est_decode_step_ms(1, 100)


def test_predictions_are_never_negative() -> None:
    negative = CostModel((-50.0, 1.0, 0.0, 0.0), (-100.0, 1.0, 0.0), 1e9, 1)
    assert negative.est_prefill_ms(10, 0) == 0.0
    assert negative.est_prefill_ms(80, 0) == 30.0
    assert negative.est_decode_step_ms(3, 0) == 0.0
    assert MODEL.est_prefill_ms(0, 512) == 0.0  # nothing to compute
    assert MODEL.est_decode_step_ms(0, 0) == 0.0  # nothing to decode
    with pytest.raises(ValueError):
        MODEL.est_prefill_ms(-1, 0)


def test_estimates_match_the_polynomials() -> None:
    assert MODEL.est_prefill_ms(100, 300) == pytest.approx(25 + 180 + 0.0004 * 30_000 + 0.0015 * 10_000)
    assert MODEL.est_decode_step_ms(8, 2000) == pytest.approx(40 + 5.6 + 6)
    assert MODEL.est_transfer_ms(1000) == pytest.approx(46080 * 1000 / 2e9 * 1e3)


@pytest.mark.parametrize("samples", [[], [PrefillSample(16, 0, 50.0)] * 3,
                                     [PrefillSample(16, 0, 0.0)] * 5,
                                     [PrefillSample(16, 0, float("inf"))] * 5])
def test_fit_refuses_samples_that_cannot_determine_it(samples: list[PrefillSample]) -> None:
    with pytest.raises(FitError, match="prefill"):
        fit_prefill(samples)


def test_json_round_trip(tmp_path: Path) -> None:
    assert CostModel.from_json(MODEL.to_json()) == MODEL
    path = tmp_path / "cm.json"
    MODEL.save(path)
    assert CostModel.load(path) == MODEL
    doc = json.loads(path.read_text())
    assert doc["version"] == 1
    assert doc["prefill_ms"]["terms"] == list(PREFILL_TERMS)
    assert doc["decode_step_ms"]["terms"] == list(DECODE_TERMS)


def test_the_measured_load_round_trips_and_scales_every_prefill() -> None:
    """`overhead_ms` and `prefill_scale` (what serve measures at start) travel in the JSON the
    dashboard serves; a profile file without them reads as 0 and 1."""
    loaded = dataclasses.replace(MODEL, overhead_ms=40.0, prefill_scale=1.25)
    assert CostModel.from_json(loaded.to_json()) == loaded
    assert "prefill_scale" not in json.loads(MODEL.to_json())
    assert loaded.est_prefill_ms(300, 100) == pytest.approx(1.25 * MODEL.est_prefill_ms(300, 100))
    assert loaded.est_prefill_step_ms([(300, 100), (50, 0)]) == pytest.approx(
        1.25 * MODEL.est_prefill_step_ms([(300, 100), (50, 0)]))
    assert loaded.est_decode_step_ms(4, 1000) == MODEL.est_decode_step_ms(4, 1000)  # decode untouched


def _mutate(path: str, value: object) -> str:
    doc = json.loads(MODEL.to_json())
    *parents, last = path.split(".")
    target = doc
    for key in parents:
        target = target[key]
    if value is _DELETE:
        del target[last]
    else:
        target[last] = value
    return json.dumps(doc)


_DELETE = object()


@pytest.mark.parametrize("path,value,field", [
    ("version", _DELETE, "version"),
    ("version", 2, "version"),
    ("version", "1", "version"),
    ("prefill_ms", _DELETE, "prefill_ms"),
    ("prefill_ms.terms", ["1", "n"], "prefill_ms.terms"),
    ("prefill_ms.coef", [1.0, 2.0], "prefill_ms.coef"),
    ("prefill_ms.coef", [1.0, "x", 0.0, 0.0], "prefill_ms.coef"),
    ("decode_step_ms.coef", _DELETE, "decode_step_ms.coef"),
    ("decode_step_ms", [1, 2, 3], "decode_step_ms"),
    ("transfer_bytes_per_s", -1.0, "transfer_bytes_per_s"),
    ("transfer_bytes_per_s", _DELETE, "transfer_bytes_per_s"),
    ("kv_bytes_per_token", 0, "kv_bytes_per_token"),
    ("kv_bytes_per_token", 1.5, "kv_bytes_per_token"),
    ("prefill_scale", 0, "prefill_scale"),
    ("prefill_scale", "x", "prefill_scale"),
])
def test_bad_json_names_the_field(path: str, value: object, field: str) -> None:
    with pytest.raises(ConfigError, match=f"'{field}'"):
        CostModel.from_json(_mutate(path, value))


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null"])
def test_not_a_cost_model_at_all(text: str) -> None:
    with pytest.raises(ConfigError, match="cost model"):
        CostModel.from_json(text)


def test_load_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read cost model"):
        CostModel.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(_mutate("version", 7))
    with pytest.raises(ConfigError, match=f"{bad}.*'version'"):
        CostModel.load(bad)


# ---------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def profiled(make_engine: EngineFactory) -> tuple[Engine, CostModel]:
    engine = make_engine(num_blocks=256)
    return engine, profile_engine(engine, quick=True)


@pytest.mark.slow
def test_quick_profile_of_the_real_engine(profiled: tuple[Engine, CostModel]) -> None:
    engine, model = profiled
    assert model.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # SmolLM2-135M fp32: layers, K/V, heads, dim
    assert all(a >= 0 for a in (*model.prefill_coef, *model.decode_coef))
    assert model.est_prefill_ms(32, 0) > 0 and model.est_decode_step_ms(1, 128) > 0
    # Monotone with margin: 8x the tokens costs well over 1.5x even on a noisy machine.
    assert model.est_prefill_ms(256, 0) > 1.5 * model.est_prefill_ms(32, 0)
    assert model.est_prefill_ms(256, 1024) >= model.est_prefill_ms(256, 0)
    assert model.est_decode_step_ms(8, 8 * 128) >= model.est_decode_step_ms(1, 128)
    assert CostModel.from_json(model.to_json()) == model
    assert_engine_idle(engine)  # the profile left no request and no block behind


@pytest.mark.slow
def test_grid_points_that_do_not_fit_are_skipped(profiled: tuple[Engine, CostModel]) -> None:
    """256 blocks x 16 = 4096 tokens: a 4096-token prefix, 32 + 4080 tokens, 99 requests (> 64
    sequences) and 40 x 300 tokens do not fit; the rest is measured, from the cache where cached."""
    engine, _ = profiled
    grid = ProfileGrid((16, 4080), (32, 4096), (1, 99, 40), (16, 300), 2, prefill_repeats=2)
    profile = measure_engine(engine, quick=True, grid=grid)
    assert [(s.n_new, s.n_cached) for s in profile.prefill] == [(16, 32)]
    measured = [(s.batch, ctx) for s in profile.decode for ctx in (16, 300)
                if ctx < s.context_tokens / s.batch < ctx + 16]
    assert measured == [(1, 16), (1, 300), (40, 16)]
    assert all(s.ms > 0 for s in (*profile.prefill, *profile.decode))
    assert_engine_idle(engine)
    # What a worker returns crosses processes (Ray pickles it) and the Conductor fits it.
    shipped = pickle.loads(pickle.dumps(profile))
    assert shipped == profile
    with pytest.raises(FitError):  # one prefill point cannot determine four coefficients
        fit_profile(shipped)


@pytest.mark.slow
def test_profile_refuses_a_busy_engine(profiled: tuple[Engine, CostModel]) -> None:
    engine, _ = profiled
    request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    try:
        with pytest.raises(ProfileError, match="busy"):
            measure_engine(engine, quick=True)
    finally:
        engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    assert_engine_idle(engine)


# ---------------------------------------------------------------------- halfmoon profile

CLI = [sys.executable, "-m", "halfmoon.cli.main", "profile"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_halfmoon_profile_writes_a_loadable_cost_model(tmp_path: Path) -> None:
    out = tmp_path / "cost_model.json"
    proc = subprocess.run([*CLI, "--quick", "--out", str(out), "--threads", "1", "--num-blocks", "256",
                           "--transfer-gbps", "3"],
                          capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr
    model = CostModel.load(out)
    assert model.transfer_bytes_per_s == 3e9
    assert "max error" in proc.stdout and "measured ms" in proc.stdout
    assert "quick profile" in model.source
    # no --dtype: serve's precision (`auto`, resolved alike), the cost model of what serve runs
    served = serve_engine()
    assert model.source.startswith(f"smollm2 {served.kv_tag} threads=1 "), model.source
    assert model.kv_bytes_per_token == 30 * 2 * 3 * 64 * served.torch_dtype.itemsize


def test_halfmoon_profile_bad_flag_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([*CLI, "--quick", "--out", str(tmp_path / "x.json"), "--transfer-gbps", "0"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2, proc.stderr
    assert "halfmoon: error:" in proc.stderr and "--transfer-gbps" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_layouts_cost_model_takes_prefill_from_one_profile_and_decode_from_the_other() -> None:
    prefill = CostModel((1.0, 2.0, 3.0, 4.0), (1.0, 1.0, 1.0),
                        1e9, 100, source="tp1")
    decode = CostModel(tuple(9.0 for _ in PREFILL_TERMS), tuple(0.5 for _ in DECODE_TERMS), 2e9, 50, source="tp2")
    both = prefill.with_decode_of(decode)
    assert (both.prefill_coef, both.decode_coef) == (prefill.prefill_coef, decode.decode_coef)
    assert (both.transfer_bytes_per_s, both.kv_bytes_per_token) == (1e9, 100)
    assert both.est_decode_step_ms(4, 100) == decode.est_decode_step_ms(4, 100)
    assert both.est_prefill_ms(64) == prefill.est_prefill_ms(64) and both.source == "prefill: tp1; decode: tp2"
