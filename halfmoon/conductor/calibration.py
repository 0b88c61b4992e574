"""What the cost model leaves out, learned online from what admitted requests measured.

The profile times the engine alone; a request also pays its RPCs, the KV handoff, the decode
join and streaming (a roughly constant cost), and, for TBT, the slowest tenth of its gaps
(Mooncake's TBT, which grows with the step). So a measurement is fitted as

    measured ≈ offset_ms + scale × predicted

over the last `WINDOW_S` of samples, by Theil–Sen (the median of the pairwise slopes, then the
median intercept): robust to a fresh server's first outliers, and right at both ends, where one
ratio over-scales a cold 3 s prefill and under-scales a warm 400 ms one. With fewer than
`MIN_FIT_SAMPLES` samples, or predictions too alike to fit a slope, the median ratio is used
(offset 0); under `MIN_SAMPLES`, nothing (scale 1). A window, not a running mean: a correction
learned under a bad minute expires even when it then rejects everything.

`Fit.guard`: the `quantile` of measured / fitted over the same samples, over their median
(in [1, `GUARD_MAX`]): how much worse than its calibrated prediction a request measures
`1 - quantile` of the time; 1 under `MIN_FIT_SAMPLES` (the p90 of four samples is their worst:
live, four first requests of a replay set a 1.54x guard that refused every later one, and no
admitted request was left to correct it, issue 38). Admission tests the calibrated prediction times the guard; what it
reports is the calibrated prediction.

Fit and guard are local: a prediction is corrected by the median measured / line of the `NEAR`
predictions nearest its own (log scale; none under `NEAR` samples), and guarded by their errors,
not the whole window's. Live, chat requests (50 ms
predicted, measured 2-4x under CPU contention) and documents (2 s predicted, measured within 20%)
shared one window after a mix shift; one line through both (no sane slope: the median ratio,
chat's, 2x) and one guard of both (1.75-1.97x) refused the documents of the next phase, which
had measured 0.63x their prediction (issue 49). `Fit.guard` is the window's, what is reported.

Beyond the largest prediction in its window (`Fit.hi_ms`) a fit is not trusted to multiply:
there it adds at the profile's own slope (its own when smaller), and the guard adds the margin
it had at that edge rather than scaling. A ratio learned on short chat prompts (a constant
overhead, 4x a 50 ms prediction, capped at 2x with a 2x guard) applied to a 1.5 s document
prefill refused every document of the next phase, and refused requests measure nothing, so the
fit never saw the range it was wrong on (issue 49). Admitted at the edge's margin, they measure,
and the next fit covers them. TBT alike: a document's predicted TBT (a long context, steps
stretched by prefills) was 3x chat's, and chat's TBT fit (x2, guard x1.49) refused every
document at a 250 ms objective.

A fit that has refused everything goes stale: when `STALE_S` passed with neither an admitted
request nor a new sample, its samples are dropped and requests are priced by the profile again
(then measured). Refused requests measure nothing, so a fit learned under one load would
otherwise outlive it by the whole window: live, after documents gave way to chat, a TBT fit of
x3 with a x2 guard refused every chat request of an 80 s phase on idle workers (issue 49).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)


class Fit(NamedTuple):
    """measured ≈ offset_ms + scale × predicted up to `hi_ms`, the largest prediction fitted;
    `guard` as in the module docstring; past `hi_ms` both add (the module docstring)."""

    offset_ms: float = 0.0
    scale: float = 1.0
    guard: float = 1.0
    hi_ms: float = math.inf
    # the samples (admission's fits; none in a plain line), in the order of their predictions:
    log_raw: tuple[float, ...] = ()  # log(predicted ms)
    line_ratios: tuple[float, ...] = ()  # measured / the line
    log_fitted: tuple[float, ...] = ()  # log(the line x its local correction)
    ratios: tuple[float, ...] = ()  # measured / that
    quantile: float = 0.5

    def __call__(self, raw_ms: float) -> float:
        if raw_ms <= self.hi_ms:
            return self._line(raw_ms) * self.correction(raw_ms)
        local = self.correction(self.hi_ms)
        return self._line(self.hi_ms) * local + min(1.0, self.scale * local) * (raw_ms - self.hi_ms)

    def _line(self, raw_ms: float) -> float:
        return self.offset_ms + self.scale * raw_ms

    def correction(self, raw_ms: float) -> float:
        """The median measured / line of the `Calibration.NEAR` predictions nearest `raw_ms`
        (log scale): 1 when the window holds no more."""
        if len(self.line_ratios) <= Calibration.NEAR or raw_ms <= 0:
            return 1.0
        return float(np.median(np.asarray(self.line_ratios)[_nearest(self.log_raw, math.log(raw_ms))]))

    def guarded(self, calibrated_ms: float) -> float:
        """`calibrated_ms` (a value of this fit) at the admit quantile: x the guard of the
        predictions nearest it up to the fitted range's edge, beyond it plus the margin the
        edge had (the module docstring)."""
        edge_ms = self(self.hi_ms) if math.isfinite(self.hi_ms) else math.inf
        if calibrated_ms <= edge_ms:
            return calibrated_ms * self.guard_near(calibrated_ms)
        return calibrated_ms + (self.guard_near(edge_ms) - 1.0) * edge_ms

    def guard_near(self, calibrated_ms: float) -> float:
        """The guard of the `Calibration.NEAR` samples fitted nearest `calibrated_ms` (log
        scale); the window's `guard` when it holds no more."""
        if len(self.ratios) <= Calibration.NEAR or calibrated_ms <= 0:
            return self.guard
        picked = _nearest(self.log_fitted, math.log(calibrated_ms))
        return _guard(np.sort(np.asarray(self.ratios)[picked]), self.quantile)


def _nearest(logs: tuple[float, ...], at: float) -> np.ndarray:
    """Indices of the `Calibration.NEAR` values of `logs` nearest `at`."""
    return np.argsort(np.abs(np.asarray(logs) - at), kind="stable")[:Calibration.NEAR]


IDENTITY = Fit()


class Calibration:
    """Two fits, TTFT and TBT (see the module docstring)."""

    WINDOW_S, MAX_SAMPLES, MIN_SAMPLES, MIN_FIT_SAMPLES, NEAR = 120.0, 64, 3, 8, 16
    REFIT_S = 1.0  # a fit over a full window is redone at most this often (new samples or not)
    MIN_SPREAD = 1.5  # a slope needs predictions at least this far apart (max / min)
    LOW, HIGH, GUARD_MAX, OFFSET_MAX_MS = 0.5, 2.0, 2.0, 5000.0
    STALE_S = 30.0  # nothing admitted nor measured for this long: the fit is dropped
    NAMES = ("TTFT", "TBT")

    def __init__(self, quantile: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.quantile = quantile
        self._samples = (deque[tuple[float, float, float]](maxlen=self.MAX_SAMPLES),
                         deque[tuple[float, float, float]](maxlen=self.MAX_SAMPLES))
        self._fits: list[tuple[object, Fit]] = [((), IDENTITY), ((), IDENTITY)]
        self._fitted_at = [-math.inf, -math.inf]
        self._added = [0, 0]  # samples ever observed, per fit: a new one means a new window
        self._admitted_at = -math.inf
        self._refused = 0  # requests refused since the last admitted one

    @property
    def ttft(self) -> Fit:
        return self._fit(0)

    @property
    def tbt(self) -> Fit:
        return self._fit(1)

    def admitted(self) -> None:
        """A request was admitted: it will measure (the fits are not stale)."""
        self._admitted_at, self._refused = self._clock(), 0

    def refused(self) -> None:
        """A request was refused: it measures nothing."""
        self._refused += 1

    def observe(self, raw_ttft_ms: float, ttft_ms: float, raw_tbt_ms: float, tbt_ms: float | None) -> None:
        """An admitted request's predictions (before calibration) and what it measured."""
        now = self._clock()
        if raw_ttft_ms > 0 and ttft_ms > 0:
            self._samples[0].append((now, raw_ttft_ms, ttft_ms))
            self._added[0] += 1
        if tbt_ms is not None and raw_tbt_ms > 0 and tbt_ms > 0:
            self._samples[1].append((now, raw_tbt_ms, tbt_ms))
            self._added[1] += 1

    def _fit(self, i: int) -> Fit:
        """Refitted when the window's samples changed; once a fit was made of MIN_FIT_SAMPLES, at
        most every REFIT_S (one more sample moves a robust fit little; at hundreds of requests a
        second, refitting on each would cost more than the prediction)."""
        now = self._clock()
        samples = self._samples[i]
        while samples and samples[0][0] < now - self.WINDOW_S:  # time only moves on: expired for good
            samples.popleft()
        if samples and now - max(samples[-1][0], self._admitted_at) > self.STALE_S:
            # a warning where it refused (a lock-out ended); a quiet spell is no news
            log.log(logging.WARNING if self._refused else logging.DEBUG,
                    "admission: nothing admitted or measured for %.0f s (%d requests refused): the %s "
                    "calibration (x%.2f, guard x%.2f) is dropped; requests are priced by the profile until "
                    "they measure again", self.STALE_S, self._refused, self.NAMES[i], self._fits[i][1].scale,
                    self._fits[i][1].guard)
            samples.clear()
        key = (self._added[i], len(samples))
        cached_key, fit = self._fits[i]
        settled = bool(cached_key) and cached_key[1] >= self.MIN_FIT_SAMPLES and now - self._fitted_at[i] < self.REFIT_S
        if cached_key != key and not settled:
            recent = [(raw, measured) for _, raw, measured in samples]
            fit = fit_samples(recent, self.quantile, adds_beyond=True) if len(recent) >= self.MIN_SAMPLES else IDENTITY
            self._fits[i], self._fitted_at[i] = (key, fit), now
        return fit


def fit_samples(samples: list[tuple[float, float]], quantile: float, adds_beyond: bool = False) -> Fit:
    """The fit of (predicted, measured) pairs (see the module docstring); `adds_beyond`: past
    the largest prediction it adds instead of multiplying, and its guard is local (admission's;
    False: the plain line and the window's guard)."""
    c = Calibration
    raw, measured = np.asarray(samples, dtype=np.float64).reshape(-1, 2).T
    ratio = float(np.median(measured / raw))
    offset, scale = 0.0, ratio
    if len(samples) >= c.MIN_FIT_SAMPLES and raw.max() >= c.MIN_SPREAD * raw.min():
        scale = _theil_sen_slope(raw, measured)
        offset = float(np.median(measured - scale * raw))
        if not 0.0 <= offset <= c.OFFSET_MAX_MS or not c.LOW <= scale <= c.HIGH:
            offset, scale = 0.0, ratio  # no sane line: a ratio
    scale = min(c.HIGH, max(c.LOW, scale))
    hi = float(raw.max()) if adds_beyond else math.inf
    if len(samples) < c.MIN_FIT_SAMPLES:  # the p90 of a handful is their worst: no guard yet
        return Fit(offset, scale, 1.0, hi)
    line = np.maximum(offset + scale * raw, 1e-9)
    if not adds_beyond:
        return Fit(offset, scale, _guard(np.sort(measured / line), quantile), hi)
    order = np.argsort(raw, kind="stable")
    raw, measured, line = raw[order], measured[order], line[order]
    log_raw, line_ratios = np.log(raw), measured / line
    local = np.ones_like(raw)
    if len(raw) > c.NEAR:  # each sample's local correction: the median of its NEAR nearest
        nearest = np.argsort(np.abs(log_raw[:, None] - log_raw[None, :]), axis=1, kind="stable")[:, :c.NEAR]
        local = np.median(line_ratios[nearest], axis=1)
    fitted = line * local
    ratios = measured / fitted
    return Fit(offset, scale, _guard(np.sort(ratios), quantile), hi, tuple(log_raw.tolist()),
               tuple(line_ratios.tolist()), tuple(np.log(fitted).tolist()), tuple(ratios.tolist()), quantile)


def _guard(sorted_ratios: np.ndarray, quantile: float) -> float:
    """The `quantile` of measured / fitted over their median, in [1, GUARD_MAX]."""
    upper = sorted_ratios[min(len(sorted_ratios) - 1, math.ceil(quantile * len(sorted_ratios)) - 1)]
    return min(Calibration.GUARD_MAX, max(1.0, float(upper / np.median(sorted_ratios))))


def _theil_sen_slope(raw: np.ndarray, measured: np.ndarray) -> float:
    """The median slope over every pair of samples with distinct predictions."""
    i, j = _pairs(len(raw))
    dr = raw[j] - raw[i]
    keep = dr != 0
    return float(np.median((measured[j] - measured[i])[keep] / dr[keep]))


@functools.lru_cache(maxsize=Calibration.MAX_SAMPLES + 1)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)
