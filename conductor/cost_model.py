"""The cost model: predicted prefill time, decode step time and KV transfer time of a worker.

Router, admission and simulator all read one `CostModel`, profiled from a real engine by
`profile_engine` (what `halfmoon profile` writes, and what a worker runs at startup when it is
given no profile file) and stored as JSON.

    prefill_ms(n, c)      = p0 + p1*n + p2*n*c + p3*n^2    n new tokens computed, c cached
    decode_step_ms(b, k)  = d0 + d1*b + d2*k               b running requests, k context tokens
    transfer_ms(t)        = t * kv_bytes_per_token / transfer_bytes_per_s * 1e3

Attention of n new tokens reads n*(n+c) keys, hence the n*c and n^2 terms; the weights are read
once per step, hence the constants. The fits are non-negative least squares weighted by 1/y (so
the relative error is what is minimised and a 50 ms point counts as much as a 5 s one): every
coefficient is >= 0, so a prediction never goes negative and never falls as n, c, b or k grow.

Transfer bandwidth is not measured here: a memcpy of KV blocks on this machine runs at ~10-30
GB/s, far above what the transport moves. The default, `DEFAULT_TRANSFER_BYTES_PER_S` = 2 GB/s,
is the low end of `halfmoon bench transport` on loopback (tcp backend 2.8-3.9 GB/s, ucxx over
UCX-tcp 2.1-2.4 GB/s, docs/BENCHMARKS.md); pass the figure of your network to `profile_engine`
(`halfmoon profile --transfer-gbps`).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from tqdm import tqdm

from engine.errors import ConfigError, HalfmoonError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine pulls in torch; this module is read by the router too
    from engine.engine import Engine

SCHEMA_VERSION = 1
PREFILL_TERMS = ("1", "n", "n*c", "n^2")
DECODE_TERMS = ("1", "b", "k")
DEFAULT_TRANSFER_BYTES_PER_S = 2.0e9
# Profile requests hash under their own salt: they never match (or pollute) a tenant's prefixes.
PROFILE_SALT = "halfmoon-profile"


class FitError(HalfmoonError, ValueError):
    """The samples cannot determine the polynomial (too few, or not finite)."""


class ProfileError(HalfmoonError):
    """The engine cannot be profiled (busy, or too small for any grid point)."""


class PrefillSample(NamedTuple):
    n_new: int
    n_cached: int
    ms: float


class DecodeSample(NamedTuple):
    batch: int
    context_tokens: int
    ms: float


class Fit(NamedTuple):
    coef: tuple[float, ...]
    max_rel_error: float  # over the samples, |fitted - measured| / measured


def prefill_features(n_new: float, n_cached: float) -> tuple[float, ...]:
    """The prefill polynomial's terms, in `PREFILL_TERMS` order."""
    return (1.0, n_new, n_new * n_cached, n_new * n_new)


def decode_features(batch: float, context_tokens: float) -> tuple[float, ...]:
    """The decode polynomial's terms, in `DECODE_TERMS` order."""
    return (1.0, batch, context_tokens)


def _poly(coef: Sequence[float], features: Sequence[float]) -> float:
    return max(0.0, math.fsum(a * x for a, x in zip(coef, features, strict=True)))


def _nnls(rows: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, exactly: with a handful of terms it is cheapest
    to solve the plain problem on every subset of terms and keep the best feasible solution."""
    best, best_cost = np.zeros(rows.shape[1]), float(np.sum(y * y))
    for k in range(1, rows.shape[1] + 1):
        for subset in itertools.combinations(range(rows.shape[1]), k):
            sol, *_ = np.linalg.lstsq(rows[:, subset], y, rcond=None)
            if np.any(sol < 0):
                continue
            cost = float(np.sum((rows[:, subset] @ sol - y) ** 2))
            if cost < best_cost - 1e-12 * max(1.0, best_cost):
                best, best_cost = np.zeros(rows.shape[1]), cost
                best[list(subset)] = sol
    return best


def _fit(features: list[tuple[float, ...]], ms: list[float], what: str) -> Fit:
    terms = len(features[0]) if features else 0
    if len(ms) < max(terms, 1):
        raise FitError(f"{what}: {len(ms)} samples cannot fit {terms} terms")
    x, y = np.asarray(features, dtype=np.float64), np.asarray(ms, dtype=np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(y <= 0):
        raise FitError(f"{what}: every sample must be finite with a positive time")
    rows = x / y[:, None]  # row i divided by y_i: the residuals are relative errors
    scale = np.max(np.abs(rows), axis=0)
    scale[scale == 0] = 1.0  # columns of similar size: 1 and n^2 differ by 1e6 otherwise
    coef = _nnls(rows / scale, np.ones_like(y)) / scale
    fitted = np.maximum(x @ coef, 0.0)
    return Fit(tuple(float(a) for a in coef), float(np.max(np.abs(fitted - y) / y)))


def fit_prefill(samples: Iterable[PrefillSample]) -> Fit:
    """Fit prefill ms over (new, cached) tokens; raises `FitError` on too few samples."""
    samples = list(samples)
    return _fit([prefill_features(s.n_new, s.n_cached) for s in samples], [s.ms for s in samples],
                "prefill")


def fit_decode(samples: Iterable[DecodeSample]) -> Fit:
    """Fit decode step ms over (batch, context tokens); raises `FitError` on too few samples."""
    samples = list(samples)
    return _fit([decode_features(s.batch, s.context_tokens) for s in samples],
                [s.ms for s in samples], "decode")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Fitted costs of one worker type (model, dtype, threads, hardware).

    prefill_coef: coefficients of `PREFILL_TERMS` (ms).
    decode_coef: coefficients of `DECODE_TERMS` (ms).
    transfer_bytes_per_s: KV fetch bandwidth between workers.
    kv_bytes_per_token: KV bytes of one token over all layers (K and V).
    source: where the numbers come from (model, dtype, threads, grid), for the operator.
    """

    prefill_coef: tuple[float, ...]
    decode_coef: tuple[float, ...]
    transfer_bytes_per_s: float
    kv_bytes_per_token: int
    source: str = ""

    def __post_init__(self) -> None:
        for name, coef, terms in (("prefill_ms.coef", self.prefill_coef, PREFILL_TERMS),
                                  ("decode_step_ms.coef", self.decode_coef, DECODE_TERMS)):
            if len(coef) != len(terms) or not all(math.isfinite(a) for a in coef):
                raise ConfigError(f"cost model field {name!r}: expected {len(terms)} finite numbers "
                                  f"for terms {list(terms)}, got {list(coef)}")
        if not (math.isfinite(self.transfer_bytes_per_s) and self.transfer_bytes_per_s > 0):
            raise ConfigError(f"cost model field 'transfer_bytes_per_s' must be > 0, "
                              f"got {self.transfer_bytes_per_s}")
        if self.kv_bytes_per_token <= 0:
            raise ConfigError(f"cost model field 'kv_bytes_per_token' must be > 0, "
                              f"got {self.kv_bytes_per_token}")

    @classmethod
    def from_samples(cls, prefill: Iterable[PrefillSample], decode: Iterable[DecodeSample], *,
                     transfer_bytes_per_s: float, kv_bytes_per_token: int, source: str = "") -> CostModel:
        """Fit both polynomials; raises `FitError` when the samples cannot determine them."""
        return cls(fit_prefill(prefill).coef, fit_decode(decode).coef, transfer_bytes_per_s,
                   kv_bytes_per_token, source)

    def est_prefill_ms(self, n_new: int, n_cached: int = 0) -> float:
        """Predicted time to compute `n_new` prompt tokens after `n_cached` cached ones."""
        if n_new < 0 or n_cached < 0:
            raise ValueError(f"token counts must be >= 0, got n_new={n_new} n_cached={n_cached}")
        return _poly(self.prefill_coef, prefill_features(n_new, n_cached)) if n_new else 0.0

    def est_decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """Predicted time of one decode step of `batch` requests holding `context_tokens` in all."""
        if batch < 0 or context_tokens < 0:
            raise ValueError(f"batch and context must be >= 0, got {batch}, {context_tokens}")
        return _poly(self.decode_coef, decode_features(batch, context_tokens)) if batch else 0.0

    def est_transfer_ms(self, n_tokens: int) -> float:
        """Predicted time to fetch the KV of `n_tokens` tokens from another holder."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return n_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s * 1e3

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        """The versioned JSON document `from_json` reads back."""
        doc = {"version": SCHEMA_VERSION,
               "prefill_ms": {"terms": list(PREFILL_TERMS), "coef": list(self.prefill_coef)},
               "decode_step_ms": {"terms": list(DECODE_TERMS), "coef": list(self.decode_coef)},
               "transfer_bytes_per_s": self.transfer_bytes_per_s,
               "kv_bytes_per_token": self.kv_bytes_per_token,
               "source": self.source}
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """Parse a cost model; raises `ConfigError` naming the field that is missing or wrong."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"cost model is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise ConfigError("cost model must be a JSON object")
        version = _field(doc, "version", int)
        if version != SCHEMA_VERSION:
            raise ConfigError(f"cost model field 'version': {version} is not supported "
                              f"(this Halfmoon reads version {SCHEMA_VERSION}); re-run halfmoon profile")
        return cls(_poly_field(doc, "prefill_ms", PREFILL_TERMS),
                   _poly_field(doc, "decode_step_ms", DECODE_TERMS),
                   float(_field(doc, "transfer_bytes_per_s", (int, float))),
                   _field(doc, "kv_bytes_per_token", int),
                   str(doc.get("source", "")))

    def save(self, path: str | Path) -> None:
        """Write the JSON document to `path`."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a cost model file; raises `ConfigError` when unreadable or malformed."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read cost model {path}: {e.strerror or e}") from e
        try:
            return cls.from_json(text)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e


def _field(doc: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in doc:
        raise ConfigError(f"cost model field {name!r} is missing")
    value = doc[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"cost model field {name!r} has the wrong type: {value!r}")
    return value


def _poly_field(doc: dict[str, Any], name: str, terms: tuple[str, ...]) -> tuple[float, ...]:
    section = _field(doc, name, dict)
    if section.get("terms") != list(terms):
        raise ConfigError(f"cost model field '{name}.terms' must be {list(terms)}, "
                          f"got {section.get('terms')!r}")
    coef = section.get("coef")
    if not isinstance(coef, list) or not all(
            isinstance(a, (int, float)) and not isinstance(a, bool) for a in coef):
        raise ConfigError(f"cost model field '{name}.coef' must be a list of numbers, got {coef!r}")
    return tuple(float(a) for a in coef)


# ---------------------------------------------------------------------- profiling a real engine


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    """Where `measure_engine` samples. Points that do not fit the engine (KV pool, context
    limit, max_num_seqs) are skipped.

    prefill_new / prefill_cached: new x cached prompt tokens (cached: multiples of block_size).
    decode_batches / decode_contexts: running requests x prompt tokens of each.
    decode_steps: timed decode steps per point (their lower quartile is the sample), after one
        untimed.
    prefill_repeats: prefills per point, each on fresh tokens (the fastest is the sample).

    Other processes only ever add time, so low statistics estimate the engine's own cost.
    """

    prefill_new: tuple[int, ...]
    prefill_cached: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int
    prefill_repeats: int = 1

    def __post_init__(self) -> None:
        sizes = (*self.prefill_new, *self.decode_batches, *self.decode_contexts, self.decode_steps,
                 self.prefill_repeats)
        if min(sizes, default=0) < 1 or min(self.prefill_cached, default=-1) < 0:
            raise ConfigError(f"profile grid needs sizes >= 1 and cached lengths >= 0: {self}")

    @property
    def num_points(self) -> int:
        return (len(self.prefill_new) * len(self.prefill_cached)
                + len(self.decode_batches) * len(self.decode_contexts))


# SmolLM2 fp32 on one thread: quick ~12 s (the decode points' prefills are most of it), full
# ~2-3 min.
QUICK_GRID = ProfileGrid((16, 64, 256, 512), (0, 256), (1, 4, 8), (16, 128), 6)
FULL_GRID = ProfileGrid((16, 32, 64, 128, 256, 512, 1024), (0, 256, 1024), (1, 2, 4, 8, 16),
                        (32, 128, 512), 8, prefill_repeats=2)


class Profile(NamedTuple):
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    kv_bytes_per_token: int
    source: str


def profile_engine(engine: Engine, *, quick: bool,
                   transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S) -> CostModel:
    """Measure `engine` (idle, not stepped by anyone else meanwhile) and fit its cost model.
    `quick` samples a small grid (what a worker runs at startup); the full grid takes minutes."""
    profile = measure_engine(engine, quick=quick)
    return CostModel.from_samples(profile.prefill, profile.decode,
                                  transfer_bytes_per_s=transfer_bytes_per_s,
                                  kv_bytes_per_token=profile.kv_bytes_per_token, source=profile.source)


def measure_engine(engine: Engine, *, quick: bool, grid: ProfileGrid | None = None) -> Profile:
    """Time prefills and decode steps of a real engine on deterministic token ids. The engine
    must be idle; it is idle again afterwards (the profile's blocks stay as salted prefix cache)."""
    if engine.has_unfinished():
        raise ProfileError("the engine is busy; profile it before it serves requests")
    grid = grid or (QUICK_GRID if quick else FULL_GRID)
    _warm_up(engine)
    # The full profile shows a progress bar; the quick one (a worker's startup) stays quiet.
    with tqdm(total=grid.num_points, desc="profile", unit="pt", disable=quick) as bar:
        prefill = _measure_prefills(engine, grid, bar.update)
        decode = _measure_decodes(engine, grid, bar.update)
    cfg = engine.config
    source = (f"{cfg.model} {cfg.dtype} threads={cfg.num_threads or 'default'} "
              f"{'quick' if quick else 'full'} profile, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return Profile(tuple(prefill), tuple(decode), kv_bytes_per_token(engine), source)


def kv_bytes_per_token(engine: Engine) -> int:
    """KV bytes of one token: layers x (K, V) x kv_heads x head_dim x itemsize."""
    kv = engine.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return kv.shape[0] * kv.shape[1] * kv.shape[4] * kv.shape[5] * kv.element_size()


def _tokens(engine: Engine, seed: int, n: int) -> list[int]:
    """Deterministic token ids, distinct per seed (so no sample hits another's cache)."""
    vocab = engine.model_config.vocab_size
    return np.random.default_rng(seed).integers(16, vocab, size=n).tolist()


def _max_prompt_tokens(engine: Engine) -> int:
    """Longest prompt that leaves room for one output token in the context and the KV pool."""
    return min(engine.max_model_len, engine.pool.num_blocks * engine.config.block_size) - 1


def _prefill_once(engine: Engine, prompt: list[int]) -> PrefillSample:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    result = engine.generate([prompt], params, cache_salt=PROFILE_SALT)[0]
    return PrefillSample(len(prompt) - result.num_cached_tokens, result.num_cached_tokens,
                         result.prefill_ms)


def _warm_up(engine: Engine) -> None:
    """First passes pay one-time costs (allocations, weight packing) that are no one's prefill."""
    for seed in (1, 2):
        _prefill_once(engine, _tokens(engine, seed, 64))


def _measure_prefills(engine: Engine, grid: ProfileGrid, tick: Callable[[int], Any]) -> list[PrefillSample]:
    """For each cached length c: compute a c-token prefix once, then prefill prefix + n fresh
    tokens for each n (the engine reports how much it actually served from its cache)."""
    samples, seed = [], 1000
    limit = _max_prompt_tokens(engine)
    for cached in grid.prefill_cached:
        fitting = [n for n in grid.prefill_new if cached + n <= limit]
        tick(len(grid.prefill_new) - len(fitting))
        if not fitting:
            continue
        prefix = _tokens(engine, seed, cached)
        seed += 1
        if cached:
            _prefill_once(engine, prefix)
        for n_new in fitting:
            runs = [_prefill_once(engine, prefix + _tokens(engine, seed + r, n_new))
                    for r in range(grid.prefill_repeats)]
            seed += grid.prefill_repeats
            samples.append(min(runs, key=lambda s: s.ms))
            tick(1)
    return samples


def _measure_decodes(engine: Engine, grid: ProfileGrid, tick: Callable[[int], Any]) -> list[DecodeSample]:
    samples = []
    for i, (batch, context) in enumerate(itertools.product(grid.decode_batches, grid.decode_contexts)):
        tick(1)
        sample = _decode_point(engine, batch, context, grid.decode_steps, seed=2000 + 100 * i)
        if sample is not None:
            samples.append(sample)
    return samples


def _decode_point(engine: Engine, batch: int, context: int, steps: int, seed: int) -> DecodeSample | None:
    """Time of one decode-only step of `batch` requests with `context`-token prompts
    (None when they do not fit). Tokens stay enough for the requests whose prefill finished
    first to keep decoding until the last one is done."""
    budget = engine.config.max_num_batched_tokens - batch  # what decodes leave to prefills
    if budget <= 0:
        return None
    max_tokens = -(-batch * context // budget) + steps + 3
    per_request = -(-(context + max_tokens) // engine.config.block_size)
    if (batch > engine.config.max_num_seqs or context + max_tokens > engine.max_model_len
            or batch * per_request > engine.pool.num_blocks):
        return None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(_tokens(engine, seed + j, context), params, cache_salt=PROFILE_SALT)
           for j in range(batch)]
    try:
        return _time_decode_steps(engine, ids, context, steps)
    finally:
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()


def _time_decode_steps(engine: Engine, ids: list[str], context: int, steps: int) -> DecodeSample:
    lengths = dict.fromkeys(ids, context)  # context tokens of each request (prompt + outputs)
    started: set[str] = set()
    times: list[float] = []
    totals: list[int] = []
    while len(times) < steps + 1:
        total, t0 = sum(lengths.values()), time.perf_counter()
        outputs = engine.step()
        elapsed = (time.perf_counter() - t0) * 1e3
        if len(started) == len(ids):  # every prefill was done before this step: a pure decode
            times.append(elapsed)
            totals.append(total)
        for out in outputs:
            if out.finished:
                raise ProfileError(f"decode point batch={len(ids)}: {out.request_id} ended early "
                                   f"({out.finish_reason}); its batch is not the one measured")
            started.add(out.request_id)
            lengths[out.request_id] += len(out.new_token_ids)
    # The first pure decode step is untimed (it may still pay for the last prefill's layout). The
    # steps do the same work, so their spread is other processes: take the lower quartile.
    low = statistics.quantiles(times[1:], n=4)[0] if steps > 1 else times[1]
    return DecodeSample(len(ids), round(statistics.fmean(totals[1:])), low)
