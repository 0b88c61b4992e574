"""The cost model: predicted prefill time, decode step time and KV transfer time of a worker.

Router, admission and simulator all read one `CostModel`, fitted here to what
engine.profiling measured on a real engine (`fit_profile`; `profile_engine` measures and fits
in one process, as `halfmoon profile` does; the Conductor fits what its first prefill worker
measured when it is given no profile file) and stored as JSON.

    prefill_ms(n, c)      = p0 + p1*n + p2*n*c + p3*n^2    n new tokens computed, c cached
    prefill_step_ms(...)  = p0 + sum of (p1*n + p2*n*c + p3*n^2)   one step of several prompts' chunks
    decode_step_ms(b, k)  = d0 + d1*b + d2*k               b running requests, k context tokens
    transfer_ms(t)        = t * kv_bytes_per_token / transfer_bytes_per_s * 1e3

Attention of n new tokens reads n*(n+c) keys, hence the n*c and n^2 terms; the weights are read
once per step, hence the constants. The fits are non-negative least squares weighted by 1/y (so
the relative error is what is minimised and a 50 ms point counts as much as a 5 s one): every
coefficient is >= 0, so a prediction never goes negative and never falls as n, c, b or k grow.

A prefill worker's engine packs its queued prompts into steps of up to max_num_batched_tokens
(engine/scheduler.py; conductor/prefill_steps.py lays a queue out so): the weights are read once
a step, so a step of several chunks pays p0 once and each chunk its tokens and its attention.

`overhead_ms`: what a request pays outside the engines (its RPCs, the KV handoff's handshake,
the decode join, streaming back through the Conductor), measured by `halfmoon serve` at start
with lone probe requests through the real path (conductor/startup_probe.py); 0 in a profile
file unless set. Admission adds it to every predicted TTFT and the simulator to every request's
handoff (`halfmoon sim`'s `--overhead-ms` defaults to it).

`prefill_scale`: how much slower the prefill worker computes while the cluster is loaded (the
decode worker stepping a batch, the Conductor streaming) than the profile's engine did alone —
on a machine whose workers share cores and memory bandwidth (this CPU's 1P1D: 1.1-1.2x, issue
38), not across GPUs. Measured by `halfmoon serve` at start with a burst of probes (conductor/
startup_probe.py); 1 in a profile file unless set. It multiplies every prefill prediction, so
admission, the simulator and the offline optimum all price the loaded machine.

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
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from halfmoon.core.errors import ConfigError, HalfmoonError
from halfmoon.core.messages import DecodeSample, PrefillSample, Profile
from halfmoon.engine.profiling import measure_engine

if TYPE_CHECKING:  # the engine pulls in torch; this module is read by the router too
    from halfmoon.engine.engine import Engine

SCHEMA_VERSION = 1
PREFILL_TERMS = ("1", "n", "n*c", "n^2")
DECODE_TERMS = ("1", "b", "k")
DEFAULT_TRANSFER_BYTES_PER_S = 2.0e9


class FitError(HalfmoonError, ValueError):
    """The samples cannot determine the polynomial (too few, or not finite)."""


class Fit(NamedTuple):
    coef: tuple[float, ...]
    max_rel_error: float  # over the samples, |fitted - measured| / measured


def prefill_features(n_new: float, n_cached: float) -> tuple[float, ...]:
    """The prefill polynomial's terms, in `PREFILL_TERMS` order."""
    return (1.0, n_new, n_new * n_cached, n_new * n_new)


def decode_features(batch: float, context_tokens: float) -> tuple[float, ...]:
    """The decode polynomial's terms, in `DECODE_TERMS` order."""
    return (1.0, batch, context_tokens)


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
    overhead_ms: per-request time outside the engines (module docstring); 0 = not measured.
    prefill_scale: the prefill worker's slowdown under load (module docstring); 1 = not measured.
    """

    prefill_coef: tuple[float, ...]
    decode_coef: tuple[float, ...]
    transfer_bytes_per_s: float
    kv_bytes_per_token: int
    source: str = ""
    overhead_ms: float = 0.0
    prefill_scale: float = 1.0

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
        if not (math.isfinite(self.overhead_ms) and self.overhead_ms >= 0):
            raise ConfigError(f"cost model field 'overhead_ms' must be >= 0, got {self.overhead_ms}")
        if not (math.isfinite(self.prefill_scale) and self.prefill_scale > 0):
            raise ConfigError(f"cost model field 'prefill_scale' must be > 0, got {self.prefill_scale}")

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
        if not n_new:
            return 0.0
        p0, p1, p2, p3 = self.prefill_coef  # PREFILL_TERMS, written out: the simulator calls this per step
        return max(0.0, p0 + n_new * (p1 + p2 * n_cached + p3 * n_new)) * self.prefill_scale

    def est_prefill_step_ms(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Predicted time of one prefill step computing several prompts' chunks, each `(n, c)`:
        n new tokens after c already computed (cached or earlier chunks). One chunk costs
        `est_prefill_ms(n, c)`; more share the step's constant (the weights are read once).
        Both carry `prefill_scale`."""
        p0, p1, p2, p3 = self.prefill_coef
        work = [n * (p1 + p2 * c + p3 * n) for n, c in chunks if n > 0]
        return max(0.0, p0 + sum(work)) * self.prefill_scale if work else 0.0

    def est_decode_step_ms(self, batch: int, context_tokens: int) -> float:
        """Predicted time of one decode step of `batch` requests holding `context_tokens` in all."""
        if batch < 0 or context_tokens < 0:
            raise ValueError(f"batch and context must be >= 0, got {batch}, {context_tokens}")
        if not batch:
            return 0.0
        d0, d1, d2 = self.decode_coef  # DECODE_TERMS, written out
        return max(0.0, d0 + d1 * batch + d2 * context_tokens)

    def est_transfer_ms(self, n_tokens: int) -> float:
        """Predicted time to fetch the KV of `n_tokens` tokens from another holder."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return n_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s * 1e3

    def with_decode_of(self, decode: CostModel) -> CostModel:
        """The cost model of a cluster whose decode workers are `decode`'s and prefill workers
        this one's (tensor-parallel layouts that differ: prefill, the KV transfer and its bytes
        from this profile, decode steps from `decode`'s)."""
        return replace(self, decode_coef=decode.decode_coef,
                       source=f"prefill: {self.source}; decode: {decode.source}")

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        """The versioned JSON document `from_json` reads back."""
        doc = {"version": SCHEMA_VERSION,
               "prefill_ms": {"terms": list(PREFILL_TERMS), "coef": list(self.prefill_coef)},
               "decode_step_ms": {"terms": list(DECODE_TERMS), "coef": list(self.decode_coef)},
               "transfer_bytes_per_s": self.transfer_bytes_per_s,
               "kv_bytes_per_token": self.kv_bytes_per_token,
               "source": self.source}
        if self.overhead_ms:
            doc["overhead_ms"] = self.overhead_ms
        if self.prefill_scale != 1.0:
            doc["prefill_scale"] = self.prefill_scale
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
                   str(doc.get("source", "")), _optional_number(doc, "overhead_ms"),
                   _optional_number(doc, "prefill_scale", 1.0))

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


def _optional_number(doc: dict[str, Any], name: str, absent: float = 0.0) -> float:
    """An optional numeric field (`absent` when absent)."""
    if name not in doc:
        return absent
    return float(_field(doc, name, (int, float)))


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


# ---------------------------------------------------------------------- from a real engine


def profile_engine(engine: Engine, *, quick: bool,
                   transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S) -> CostModel:
    """Measure `engine` (idle, not stepped by anyone else meanwhile) and fit its cost model.
    `quick` samples a small grid (what a worker runs at startup); the full grid takes minutes."""
    return fit_profile(measure_engine(engine, quick=quick), transfer_bytes_per_s)


def fit_profile(profile: Profile, transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S) -> CostModel:
    """The cost model fitted to a worker's measurements (engine.profiling.measure_engine)."""
    return CostModel.from_samples(profile.prefill, profile.decode,
                                  transfer_bytes_per_s=transfer_bytes_per_s,
                                  kv_bytes_per_token=profile.kv_bytes_per_token, source=profile.source)
