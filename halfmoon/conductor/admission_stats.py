"""What admission decided and how good its predictions were, kept as plain counters for
`/metrics` (api/metrics.py reads a snapshot at scrape time; nothing here imports Prometheus).

    decisions[(class, outcome, reason)]   outcome "admitted" (reason "") or "rejected"
    ttft_error / tbt_error                predicted - measured, seconds, per admitted request

Measured TBT is Mooncake's (as `halfmoon bench serve` measures it): the mean of the longest 10%
of a request's token-to-token gaps, kept per request in a heap of fixed size (`TopGaps`); a chunk
of n tokens arriving g after the previous one (a speculative verification) is n gaps of g / n.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from dataclasses import dataclass, field

# Signed error buckets (s): symmetric around 0, finer near it.
ERROR_BUCKETS = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.2, -0.1, -0.05, -0.02, -0.01, 0.0,
                 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram (Prometheus' shape): counts[i] = observations <= bounds[i]."""

    bounds: tuple[float, ...] = ERROR_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.bounds):
            self.counts[i] += 1

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


# Admission learns no TBT from a stream of fewer gaps (Dispatcher.finished): in 1P1D a stream's first
# two tokens arrive together (~2 ms apart), so a 2-token stream's one gap is ~0 and, learned from,
# pulls the TBT calibration down to its floor (sim-vs-live run 2's probes).
MIN_SAMPLE_GAPS = 4


class TopGaps:
    """The longest max(1, (max_tokens - 1) // 10) token gaps of one stream, and their mean."""

    __slots__ = ("_heap", "_k", "_last", "gaps")

    def __init__(self, max_tokens: int) -> None:
        self._k = max(1, (max_tokens - 1) // 10)
        self._heap: list[float] = []
        self._last: float | None = None
        self.gaps = 0

    def tick(self, now: float, tokens: int = 1) -> None:
        """`tokens` arrived at `now`: a chunk of n tokens after a gap g counts as n gaps of g / n
        (a speculative verification's tokens: the pace a client rendering evenly sees)."""
        if self._last is not None:
            for _ in range(tokens):
                self._push((now - self._last) / tokens)
        self._last = now

    def _push(self, gap: float) -> None:
        self.gaps += 1
        if len(self._heap) < self._k:
            heapq.heappush(self._heap, gap)
        elif gap > self._heap[0]:
            heapq.heapreplace(self._heap, gap)

    def mean_s(self) -> float | None:
        """Mean of the longest tenth of the gaps seen (None before two tokens)."""
        if not self.gaps:
            return None
        top = heapq.nlargest(min(max(1, self.gaps // 10), len(self._heap)), self._heap)
        return sum(top) / len(top)


@dataclass(slots=True)
class AdmissionStats:
    decisions: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    ttft_error: Histogram = field(default_factory=Histogram)
    tbt_error: Histogram = field(default_factory=Histogram)

    def admitted(self, class_name: str) -> None:
        self.decisions[(class_name, "admitted", "")] += 1

    def rejected(self, class_name: str, reason: str) -> None:
        self.decisions[(class_name, "rejected", reason)] += 1

    def measured(self, predicted_ttft_ms: float, ttft_s: float, predicted_tbt_ms: float,
                 tbt_s: float | None) -> None:
        """An admitted request finished: its prediction errors (predicted - measured)."""
        self.ttft_error.observe(predicted_ttft_ms / 1e3 - ttft_s)
        if tbt_s is not None:
            self.tbt_error.observe(predicted_tbt_ms / 1e3 - tbt_s)
