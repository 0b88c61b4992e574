"""The planner: which prefill:decode split the cluster should run, decided from the traffic it
just served (`--planner off|advise|act`, issue 49).

Every `interval_s` the Conductor hands `Planner.tick` the requests of the last `window_s`
(`Traffic`: arrival, prompt and output lengths, whether each met its SLOs) and the split it runs
now. An `Advisor` (the simulator's: sim/advisor.py, the same code as the sizing page) replays
that window through every split the pools' bounds allow and predicts each one's goodput; the
planner moves one step toward the best:

    scores = advisor.score(window, splits)          split -> predicted goodput (requests/s)
    target = the best split (ties: the split now, then fewer workers)
    gain   = (score[target] - score[now]) / score[now]
    move   = target != now, gain >= min_gain, the same target advised `confirm` ticks in a row,
             and the target not rolled back within `cooldown_s`
             -> one step: flip a worker (same total), else add or remove one (total bounds)

At most one change per tick. A move is judged `judge_s` after it: when the SLO attainment of
the requests that arrived since is `rollback_margin` below that of the window before it, the
move is rolled back (one step back) and its target is not advised again for `cooldown_s`
(hysteresis: a noisy steady load never makes the planner flap).

The planner decides; it does not act. The Conductor (conductor/planner_loop.py) applies a move
in `act` mode (conductor/rebalance.py: drain, flip, add, remove) and only logs it in `advise`;
the simulator applies it to its simulated workers (sim/planned.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple, Protocol

from halfmoon.conductor.admission import Objective
from halfmoon.core.errors import ConfigError

PlannerMode = Literal["off", "advise", "act"]
Action = Literal["hold", "flip", "add", "remove", "rollback"]
MODES: tuple[PlannerMode, ...] = ("off", "advise", "act")
TIES = 0.01  # scores within 1% of the best tie
MAX_CANDIDATES = 24  # splits the advisor replays per tick (a spread of them beyond)


class Split(NamedTuple):
    """Prefill and decode workers."""

    prefill: int
    decode: int

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """How the planner decides (`halfmoon serve --planner...`, HALFMOON_PLANNER..., Helm `planner.*`).

    mode: off (no planner), advise (decisions logged, shown and exported, nothing changes),
        act (the Conductor applies them).
    interval_s: how often it decides; window_s: the traffic it replays each time.
    min_prefill, max_prefill, min_decode, max_decode: each pool's bounds (None max: no bound
        but the total's).
    min_workers, max_workers: the total's bounds (None: the total at start, so only flips;
        wider bounds let it add and remove workers).
    min_gain: the predicted goodput gain (relative) a move needs.
    confirm: ticks in a row a move must be advised before it is made.
    judge_s: how long after a move it is judged; rollback_margin: the drop in SLO attainment
        (0-1) that rolls it back; cooldown_s: how long a rolled-back target stays out.
    drain_s: how long a worker leaving its pool lets its requests finish before the rest move
        (conductor/migration.py).
    """

    mode: PlannerMode = "advise"
    interval_s: float = 30.0
    window_s: float = 60.0
    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None
    min_workers: int | None = None
    max_workers: int | None = None
    min_gain: float = 0.10
    confirm: int = 2
    judge_s: float = 60.0
    rollback_margin: float = 0.05
    cooldown_s: float = 300.0
    drain_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"planner mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("interval_s", "window_s", "judge_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"planner {name} must be > 0, got {getattr(self, name)}")
        for name in ("min_gain", "cooldown_s", "drain_s", "rollback_margin"):
            if getattr(self, name) < 0:
                raise ConfigError(f"planner {name} must be >= 0, got {getattr(self, name)}")
        if self.confirm < 1:
            raise ConfigError(f"planner confirm must be >= 1, got {self.confirm}")
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if low < 1 or (high is not None and high < low):
                raise ConfigError(f"planner bounds of the {role} pool must be 1 <= min <= max, got {low}..{high}")
        if self.min_workers is not None and self.max_workers is not None and self.max_workers < self.min_workers:
            raise ConfigError(f"planner max_workers {self.max_workers} < min_workers {self.min_workers}")

    def bounded(self, start: Split) -> PlannerConfig:
        """With the total's bounds filled in from the split at start (None: that total)."""
        return replace(self, min_workers=start.total if self.min_workers is None else self.min_workers,
                       max_workers=start.total if self.max_workers is None else self.max_workers)

    def splits(self) -> list[Split]:
        """Every split within the bounds (`bounded` first), fewest workers first."""
        assert self.min_workers is not None and self.max_workers is not None, "bounded() first"
        top_p = self.max_prefill or self.max_workers
        top_d = self.max_decode or self.max_workers
        return [Split(p, total - p) for total in range(max(self.min_workers, 2), self.max_workers + 1)
                for p in range(self.min_prefill, min(top_p, total - self.min_decode) + 1)
                if total - p <= top_d]


@dataclass(frozen=True, slots=True)
class Seen:
    """One request as the planner saw it: arrival (s, any clock), lengths, and how it ended
    (`met`: both SLOs met; None while it runs; `rejected`: refused at the door)."""

    arrival: float
    prompt_len: int
    output_len: int
    met: bool | None = None
    rejected: bool = False


class Traffic:
    """The recent requests, as the Conductor (or the simulator) saw them arrive and end."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._seen: deque[tuple[str, list[Seen]]] = deque()  # arrival order; each Seen in a cell of its own
        self._cells: dict[str, list[Seen]] = {}  # key -> its cell: an end is found in O(1)

    def arrived(self, key: str, at: float, prompt_len: int, max_tokens: int) -> None:
        self._forget(at)
        cell = [Seen(at, prompt_len, max_tokens)]
        self._seen.append((key, cell))
        self._cells[key] = cell

    def ended(self, key: str, output_len: int, met: bool, rejected: bool = False) -> None:
        """How `key` ended (its output length replaces the max_tokens it asked for)."""
        cell = self._cells.get(key)
        if cell is not None:
            s = cell[0]
            cell[0] = replace(s, output_len=max(1, output_len) if output_len else s.output_len, met=met,
                              rejected=rejected)

    def window(self, now: float, window_s: float) -> list[Seen]:
        self._forget(now)
        return [cell[0] for _, cell in self._seen if cell[0].arrival >= now - window_s]

    def _forget(self, now: float) -> None:
        while self._seen and self._seen[0][1][0].arrival < now - self.keep_s:
            key, cell = self._seen.popleft()
            if self._cells.get(key) is cell:
                del self._cells[key]


def met_slo(objective: Objective, ttft_ms: float, tbt_s: float | None) -> bool:
    """Whether a finished request met both of its objectives (inf: none)."""
    return ttft_ms <= objective.ttft_ms and (tbt_s is None or tbt_s * 1e3 <= objective.tbt_ms)


def attainment(seen: Iterable[Seen]) -> float | None:
    """The share of the ended requests that met their SLOs (rejected ones count as missed)."""
    ended = [s for s in seen if s.met is not None]
    return None if not ended else sum(bool(s.met) for s in ended) / len(ended)


class Advisor(Protocol):
    def score(self, window: Sequence[Seen], window_s: float, splits: Sequence[Split]) -> dict[Split, float]:
        """Each split's predicted goodput (requests/s meeting both SLOs) on `window`."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One tick's outcome. `at`: the planner's clock; `role`: the pool a flip moves a worker to,
    or the pool that gains (add) or loses (remove) one; `gain`: the predicted goodput ratio of
    `target` over `current` minus 1; `scores`: each split's predicted goodput."""

    at: float
    action: Action
    current: Split
    target: Split
    reason: str
    role: str | None = None
    gain: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    applied: bool = False
    waiting: bool = False  # a hold only until the move is confirmed (the target is where it heads)

    @property
    def moves(self) -> bool:
        return self.action != "hold"

    @property
    def next_split(self) -> Split:
        """The split after this decision's one step."""
        if self.action == "hold" or self.role is None:
            return self.current
        return stepped(self.current, self.target, self.role)

    def view(self) -> dict[str, object]:
        return {"at": self.at, "action": self.action, "current": str(self.current), "target": str(self.target),
                "next": str(self.next_split), "role": self.role, "gain": round(self.gain, 4),
                "reason": self.reason, "scores": {k: round(v, 4) for k, v in self.scores.items()},
                "applied": self.applied}


@dataclass(slots=True)
class _Move:
    """A move not judged yet: the split before it, the one after its step, its target."""

    at: float
    before: Split
    after: Split
    target: Split
    attainment_before: float | None


class Planner:
    """The decisions (module docstring); `config` must be `bounded`."""

    def __init__(self, config: PlannerConfig, advisor: Advisor) -> None:
        assert config.min_workers is not None, "PlannerConfig.bounded(start split) first"
        self.config = config
        self.advisor = advisor
        self._streak: tuple[Split | None, int] = (None, 0)
        self._last: _Move | None = None  # the move not judged yet
        self._blocked: dict[Split, float] = {}  # rolled-back target -> until

    def tick(self, now: float, current: Split, window: Sequence[Seen]) -> Decision:
        """This interval's decision (the caller applies a move and says so with `applied`)."""
        judged = self._judge(now, current, window)
        if judged is not None:
            return judged
        splits = candidates(self.config.splits(), current)
        scores = self.advisor.score(window, self.config.window_s, splits)
        labels = {str(s): v for s, v in scores.items()}
        target = best_split(scores, current)
        if target == current:
            self._streak = (None, 0)
            return Decision(now, "hold", current, current, f"{current} serves the last window best", scores=labels)
        gain = _gain(scores[target], scores[current], self.config.window_s)
        held = self._held(now, current, target, gain)
        if held is not None:
            waiting = self._streak[0] == target
            return Decision(now, "hold", current, target, held, gain=gain, scores=labels, waiting=waiting)
        action, role = step_toward(current, target)
        self._streak = (None, 0)
        decision = Decision(now, action, current, target,
                            f"{target} is predicted to serve {gain:+.0%} goodput over {current} "
                            f"({scores[target]:.2f} vs {scores[current]:.2f} req/s on the last "
                            f"{self.config.window_s:g} s)", role, gain, labels)
        self._last = _Move(now, current, decision.next_split, target, attainment(window))
        return decision

    def _held(self, now: float, current: Split, target: Split, gain: float) -> str | None:
        """Why a better `target` is not moved toward yet (None: move)."""
        until = self._blocked.get(target, -math.inf)
        if now < until:
            self._streak = (None, 0)
            return f"{target} was rolled back; not tried again for {until - now:.0f} s"
        if gain < self.config.min_gain and target.total >= current.total:
            self._streak = (None, 0)
            return f"{target} would gain {gain:+.0%}, under the {self.config.min_gain:.0%} a move needs"
        move = self._last
        if move is not None and now - move.at < self.config.judge_s and self._undoes(move, current, target):
            self._streak = (None, 0)
            return (f"moving toward {target} would undo {move.before} -> {move.after} before it is judged "
                    f"({move.at + self.config.judge_s - now:.0f} s): no flapping")
        same, count = self._streak
        count = count + 1 if same == target else 1
        self._streak = (target, count)
        if count < self.config.confirm:
            return f"{target} advised {count} of {self.config.confirm} ticks in a row"
        return None

    @staticmethod
    def _undoes(move: _Move, current: Split, target: Split) -> bool:
        """One step from `current` toward `target` lands on the split `move` left."""
        return stepped(current, target, step_toward(current, target)[1]) == move.before

    def _judge(self, now: float, current: Split, window: Sequence[Seen]) -> Decision | None:
        """Roll the last move back when what arrived since did worse than what came before and
        the traffic since does not explain it: the advisor, replaying the requests that arrived
        since the move, does not find the new split better than the old one (a mix that shifted
        right after a good move lowers attainment too; that is no reason to undo it)."""
        move = self._last
        if move is None or now - move.at < self.config.judge_s:
            return None
        self._last = None
        if current != move.after:  # not applied (advise), or the split changed since
            return None
        arrived = [s for s in window if s.arrival >= move.at]
        since = attainment(arrived)
        if since is None or move.attainment_before is None or \
                since >= move.attainment_before - self.config.rollback_margin:
            return None
        scores = self.advisor.score(arrived, now - move.at, [move.before, current])
        if scores[current] > scores[move.before]:
            return None
        self._blocked[move.after] = self._blocked[move.target] = now + self.config.cooldown_s
        action, role = step_toward(current, move.before)
        return Decision(now, "rollback", current, move.before,
                        f"since the move to {current} SLO attainment fell to {since:.0%} from "
                        f"{move.attainment_before:.0%} and {move.before} would have served the same traffic "
                        f"as well: rolled back, {move.after} kept out for {self.config.cooldown_s:g} s", role,
                        scores={str(k): v for k, v in scores.items()})


def best_split(scores: dict[Split, float], current: Split) -> Split:
    """The split of the most goodput; within TIES of it: fewer workers (scaling down when the
    bounds allow), then the split now, then fewer prefill workers."""
    top = max(scores.values())
    close = [s for s, v in scores.items() if v >= top * (1 - TIES) - 1e-12]
    return min(close, key=lambda s: (s.total, s != current, s.prefill))


def candidates(splits: Sequence[Split], current: Split, most: int = MAX_CANDIDATES) -> list[Split]:
    """The splits to score: all of them up to `most`; beyond (hundreds of workers), the
    current one, its neighbours within two steps and an even spread of the rest."""
    if len(splits) <= most:
        return sorted({*splits, current})
    near = [s for s in splits if max(abs(s.prefill - current.prefill), abs(s.decode - current.decode)) <= 2]
    stride = max(1, len(splits) // (most - len(near) - 1))
    return sorted({current, *near, *splits[::stride]})


def step_toward(current: Split, target: Split) -> tuple[Action, str]:
    """The one change from `current` toward `target`: a flip when the totals are equal, else an
    add or a remove in the pool that differs (the role named: where a worker goes or leaves)."""
    if current.total == target.total:
        return "flip", "prefill" if target.prefill > current.prefill else "decode"
    if target.total > current.total:
        return "add", "prefill" if target.prefill > current.prefill else "decode"
    return "remove", "prefill" if target.prefill < current.prefill else "decode"


def stepped(current: Split, target: Split, role: str) -> Split:
    """The split after one step from `current` toward `target` (`role`: as `step_toward` names it)."""
    p, d = current
    if current.total == target.total:  # a flip (or a flip rolled back)
        return Split(p + 1, d - 1) if role == "prefill" else Split(p - 1, d + 1)
    sign = 1 if target.total > current.total else -1  # an add or a remove
    return Split(p + sign, d) if role == "prefill" else Split(p, d + sign)


def _gain(best: float, now: float, window_s: float) -> float:
    """Relative gain, with now's goodput floored at one request per window (an idle window
    gains nothing from any move)."""
    return (best - now) / max(now, 1.0 / window_s)
