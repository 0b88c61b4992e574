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
`1 - quantile` of the time. Admission tests the calibrated prediction times the guard; what it
reports is the calibrated prediction.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple


class Fit(NamedTuple):
    """measured ≈ offset_ms + scale × predicted; `guard` as in the module docstring."""

    offset_ms: float = 0.0
    scale: float = 1.0
    guard: float = 1.0

    def __call__(self, raw_ms: float) -> float:
        return self.offset_ms + self.scale * raw_ms


IDENTITY = Fit()


class Calibration:
    """Two fits, TTFT and TBT (see the module docstring)."""

    WINDOW_S, MAX_SAMPLES, MIN_SAMPLES, MIN_FIT_SAMPLES = 120.0, 64, 3, 8
    MIN_SPREAD = 1.5  # a slope needs predictions at least this far apart (max / min)
    LOW, HIGH, GUARD_MAX, OFFSET_MAX_MS = 0.5, 2.0, 2.0, 5000.0

    def __init__(self, quantile: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.quantile = quantile
        self._samples = (deque[tuple[float, float, float]](maxlen=self.MAX_SAMPLES),
                         deque[tuple[float, float, float]](maxlen=self.MAX_SAMPLES))
        self._fits: list[tuple[object, Fit]] = [((), IDENTITY), ((), IDENTITY)]

    @property
    def ttft(self) -> Fit:
        return self._fit(0)

    @property
    def tbt(self) -> Fit:
        return self._fit(1)

    def observe(self, raw_ttft_ms: float, ttft_ms: float, raw_tbt_ms: float, tbt_ms: float | None) -> None:
        """An admitted request's predictions (before calibration) and what it measured."""
        now = self._clock()
        if raw_ttft_ms > 0 and ttft_ms > 0:
            self._samples[0].append((now, raw_ttft_ms, ttft_ms))
        if tbt_ms is not None and raw_tbt_ms > 0 and tbt_ms > 0:
            self._samples[1].append((now, raw_tbt_ms, tbt_ms))

    def _fit(self, i: int) -> Fit:
        since = self._clock() - self.WINDOW_S
        window = [s for s in self._samples[i] if s[0] >= since]
        key = (len(window), window[0][0], window[-1][0]) if window else ()
        recent = [(raw, measured) for _, raw, measured in window]
        cached_key, fit = self._fits[i]
        if cached_key != key:  # refitted only when the window's samples changed
            fit = fit_samples(recent, self.quantile) if len(recent) >= self.MIN_SAMPLES else IDENTITY
            self._fits[i] = (key, fit)
        return fit


def fit_samples(samples: list[tuple[float, float]], quantile: float) -> Fit:
    """The fit of (predicted, measured) pairs (see the module docstring)."""
    c = Calibration
    raws = [raw for raw, _ in samples]
    offset, scale = 0.0, statistics.median(m / r for r, m in samples)
    if len(samples) >= c.MIN_FIT_SAMPLES and max(raws) >= c.MIN_SPREAD * min(raws):
        scale = _theil_sen_slope(samples)
        offset = statistics.median(m - scale * r for r, m in samples)
        if not 0.0 <= offset <= c.OFFSET_MAX_MS or not c.LOW <= scale <= c.HIGH:
            offset, scale = 0.0, statistics.median(m / r for r, m in samples)  # no sane line: a ratio
    scale = min(c.HIGH, max(c.LOW, scale))
    fitted = Fit(offset, scale)
    ratios = sorted(m / max(fitted(r), 1e-9) for r, m in samples)
    upper = ratios[min(len(ratios) - 1, math.ceil(quantile * len(ratios)) - 1)]
    guard = min(c.GUARD_MAX, max(1.0, upper / statistics.median(ratios)))
    return Fit(offset, scale, guard)


def _theil_sen_slope(samples: list[tuple[float, float]]) -> float:
    slopes = [(m2 - m1) / (r2 - r1) for k, (r1, m1) in enumerate(samples) for r2, m2 in samples[k + 1:]
              if r2 != r1]
    return statistics.median(slopes)
