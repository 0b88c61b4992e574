"""The front door's recent history, for the operator dashboard (dashboard/): what finished, how
fast, within its SLO or not, what was rejected and why, in time bins over the last minutes; and
the traffic itself, recorded in the Mooncake trace format so the sizing page can replay "the
last N minutes" through the simulator.

    window.finished(end, objective)    a request's last chunk (RequestEnd) and its objectives
    window.rejected(reason)            admission said no (429)
    window.failed()                    any other error a client received
    window.snapshot()                  -> LiveSnapshot (series, last-minute figures, totals)
    traffic.record(arrival, prompt_ids, output_tokens, cache_salt, adapter)
    traffic.rows(since)                -> [TraceEntry] (Mooncake lines: ms from the first, lengths, hash ids)

Both are fed on the server's event loop; the sizing job reads the traffic from a thread, so each
keeps a lock. Memory is bounded: at most `max_samples` latencies per bin (a seeded reservoir
beyond that) and `max_rows` recorded requests.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from halfmoon.conductor.admission import Objective
from halfmoon.core.messages import RequestEnd

HASH_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace format
RECENT_S = 60.0  # the "now" figures: rates and shares over the last minute
QUANTILES = (50, 90, 99)


@dataclass(slots=True)
class _Bin:
    start: float
    finished: int = 0
    good: int = 0  # finished within both objectives
    rejected: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    tbt_ms: list[float] = field(default_factory=list)
    seen_ttft: int = 0  # samples offered (the reservoir keeps `max_samples` of them)
    seen_tbt: int = 0


@dataclass(frozen=True, slots=True)
class Series:
    """One value per bin, oldest first (None: no finished request in that bin)."""

    bin_s: float
    t: list[float]
    request_rate: list[float]
    goodput_rps: list[float]
    rejected_rps: list[float]
    ttft_ms: dict[str, list[float | None]]
    tbt_ms: dict[str, list[float | None]]


@dataclass(frozen=True, slots=True)
class LiveSnapshot:
    """The last minute's rates and shares, totals since start, and the binned history."""

    request_rate: float
    goodput_rps: float
    slo_attainment: float | None  # None: nothing finished in the last minute
    cached_share: float | None  # prompt tokens served from cache / prompt tokens, last minute
    finished: int
    rejected: dict[str, int]
    errors: int
    series: Series


def meets(end: RequestEnd, objective: Objective) -> bool:
    """Whether a finished request met both its objectives (its TBT: mean time per output token
    after the first; a one-token answer has none). No objective = met."""
    t = end.timings
    tbt_ok = end.usage.completion_tokens <= 1 or t.mean_tpot_ms <= objective.tbt_ms
    return t.ttft_ms <= objective.ttft_ms and tbt_ok


class LiveWindow:
    def __init__(self, bin_s: float = 5.0, history_s: float = 600.0, max_samples: int = 512,
                 clock: Callable[[], float] = time.time) -> None:
        if not 0 < bin_s <= history_s:
            raise ValueError(f"need 0 < bin_s <= history_s, got {bin_s}, {history_s}")
        self.bin_s, self.max_samples, self._clock = bin_s, max_samples, clock
        self._bins: deque[_Bin] = deque(maxlen=math.ceil(history_s / bin_s))
        self._rejected: Counter[str] = Counter()
        self._finished = self._errors = 0
        self._started = clock()
        self._random = random.Random(0)
        self._lock = threading.Lock()

    def finished(self, end: RequestEnd, objective: Objective) -> None:
        t, u = end.timings, end.usage
        tbt = t.mean_tpot_ms if u.completion_tokens > 1 else None
        good = meets(end, objective)
        with self._lock:
            b = self._bin()
            b.finished += 1
            b.good += good
            b.prompt_tokens += u.prompt_tokens
            b.cached_tokens += u.cached_prompt_tokens
            b.seen_ttft = self._sample(b.ttft_ms, b.seen_ttft, t.ttft_ms)
            if tbt is not None:
                b.seen_tbt = self._sample(b.tbt_ms, b.seen_tbt, tbt)
            self._finished += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._bin().rejected += 1
            self._rejected[reason or "overloaded"] += 1

    def failed(self) -> None:
        with self._lock:
            self._bin().errors += 1
            self._errors += 1

    def snapshot(self) -> LiveSnapshot:
        now = self._clock()
        with self._lock:
            bins = self._timeline(now)
            recent = [b for b in bins if b.start + self.bin_s > now - RECENT_S]
            finished = sum(b.finished for b in recent)
            good = sum(b.good for b in recent)
            prompt = sum(b.prompt_tokens for b in recent)
            span = max(self.bin_s, min(RECENT_S, now - self._started))
            return LiveSnapshot(finished / span, good / span, good / finished if finished else None,
                                sum(b.cached_tokens for b in recent) / prompt if prompt else None,
                                self._finished, dict(self._rejected), self._errors, self._series(bins))

    # ------------------------------------------------------------------ internals

    def _bin(self) -> _Bin:
        start = math.floor(self._clock() / self.bin_s) * self.bin_s
        if not self._bins or self._bins[-1].start < start:
            self._bins.append(_Bin(start))
        return self._bins[-1]

    def _sample(self, values: list[float], seen: int, value: float) -> int:
        """Reservoir sampling: every offered value is kept with the same probability."""
        if len(values) < self.max_samples:
            values.append(value)
        else:
            slot = self._random.randrange(seen + 1)
            if slot < self.max_samples:
                values[slot] = value
        return seen + 1

    def _timeline(self, now: float) -> list[_Bin]:
        """Every bin of the history up to now, empty ones included (gaps are explicit)."""
        last = math.floor(now / self.bin_s) * self.bin_s
        first = last - (self._bins.maxlen - 1) * self.bin_s  # type: ignore[operator]
        have = {b.start: b for b in self._bins if b.start >= first}
        count = self._bins.maxlen or 0
        return [have.get(first + i * self.bin_s) or _Bin(first + i * self.bin_s) for i in range(count)]

    def _series(self, bins: Sequence[_Bin]) -> Series:
        per_s = 1.0 / self.bin_s
        return Series(self.bin_s, [b.start for b in bins], [b.finished * per_s for b in bins],
                      [b.good * per_s for b in bins], [b.rejected * per_s for b in bins],
                      _quantiles([b.ttft_ms for b in bins]), _quantiles([b.tbt_ms for b in bins]))


def _quantiles(samples: Sequence[list[float]]) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {f"p{q}": [] for q in QUANTILES}
    for values in samples:
        ordered = sorted(values)
        for q in QUANTILES:
            out[f"p{q}"].append(_percentile(ordered, q))
    return out


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), on sorted values."""
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 3)


@dataclass(frozen=True, slots=True)
class TrafficRow:
    """One recorded request: arrival (Unix s), prompt length, tokens it made (or asked for,
    if it was rejected), and the chained ids of its 512-token prompt blocks."""

    arrival: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    adapter: str = ""


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """A recorded request as a Mooncake trace line: `{"timestamp": ..., "input_length": ...,
    "output_length": ..., "hash_ids": [...]}` (`as_json`), and `"adapter"` for a request under a
    LoRA adapter (sim/trace.py reads it)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    adapter: str = ""

    def as_json(self) -> dict[str, object]:
        row: dict[str, object] = {"timestamp": self.timestamp_ms, "input_length": self.input_length,
                                  "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        if self.adapter:
            row["adapter"] = self.adapter
        return row


class TrafficRecorder:
    """The last `max_rows` requests, as a Mooncake trace. Hash ids are chained digests of each
    512-token block (and the cache salt, so tenants never share), numbered in order of first
    appearance: two recorded prompts share a hash id exactly when they share that prefix."""

    def __init__(self, max_rows: int = 100_000, max_ids: int = 1_000_000) -> None:
        self._rows: deque[TrafficRow] = deque(maxlen=max_rows)
        self._ids: dict[bytes, int] = {}
        self._max_ids = max_ids
        self._lock = threading.Lock()

    def record(self, arrival: float, prompt_ids: Sequence[int], output_tokens: int,
               cache_salt: str | None = None, adapter: str = "") -> None:
        """`adapter`: the LoRA adapter's name ("" = the base model); it roots the hash ids too."""
        digests = _block_digests(prompt_ids, f"{cache_salt or ''}\0{adapter}" if adapter else cache_salt)
        with self._lock:
            if len(self._ids) + len(digests) > self._max_ids:
                self._ids.clear()  # older rows keep their ids; new prefixes count as new
            ids = tuple(self._ids.setdefault(d, len(self._ids)) for d in digests)
            self._rows.append(TrafficRow(arrival, len(prompt_ids), output_tokens, ids, adapter))

    def rows(self, since: float) -> list[TraceEntry]:
        """Requests that arrived at or after `since` (Unix s), oldest first, timed from the first
        of them (a Mooncake trace's `timestamp`, ms)."""
        with self._lock:
            chosen = sorted((r for r in self._rows if r.arrival >= since), key=lambda r: r.arrival)
        t0 = chosen[0].arrival if chosen else 0.0
        return [TraceEntry(round((r.arrival - t0) * 1e3, 3), r.input_length, r.output_length, r.hash_ids,
                           r.adapter) for r in chosen]

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)


def _block_digests(prompt_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
    tokens = array("I", prompt_ids).tobytes()
    step = HASH_BLOCK_TOKENS * 4
    parent = hashlib.blake2b((cache_salt or "").encode(), digest_size=16).digest()
    out = []
    for i in range(0, len(tokens), step):
        parent = hashlib.blake2b(parent + tokens[i:i + step], digest_size=16).digest()
        out.append(parent)
    return out
