"""The live document's arithmetic (dashboard/live.py) on hand-made worker histories: rates from
counter differences, prefix hits per tier over prompt tokens. The backend here is a stand-in
(named as such) that only returns the snapshot under test; tests/dashboard/test_api.py and
test_browser.py run the real ones."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.backend import BackendStats, WorkerView
from halfmoon.conductor.live import LiveWindow
from halfmoon.conductor.planner import Decision, Split
from halfmoon.conductor.planner_loop import PlannerSnapshot
from halfmoon.core.messages import WorkerLoad
from halfmoon.dashboard.live import LiveView


def load(steps: int, computed: int, cached: int, from_host: int = 0, remote: int = 0, received: int = 0,
         **kw: int) -> WorkerLoad:
    return WorkerLoad(True, steps, 90, 100, 1, computed, cached, remote, blocks_from_host=from_host,
                      kv_bytes_received=received, **kw)


def view(wid: str, role: str, history: list[tuple[float, WorkerLoad]]) -> WorkerView:
    at, last = history[-1]
    return WorkerView(wid, role, True, 0, 2, last, at, tuple(history))


class StandInBackend:
    """Only what LiveView reads: the snapshot and the backend's descriptors."""

    def __init__(self, workers: tuple[WorkerView, ...], planner: PlannerSnapshot | None = None) -> None:
        self.workers = workers
        self.planner = planner
        self.admission_config = AdmissionConfig()
        self.model = SimpleNamespace(id="m", architecture="llama", dtype="float32", max_model_len=128)
        self.mode, self.block_size = "cluster", 16

    def stats(self) -> BackendStats:
        return BackendStats(1, 0, 90, 100, 0, workers=self.workers, planner=self.planner)

    def ready(self) -> bool:
        return True


def document(workers: tuple[WorkerView, ...], planner: PlannerSnapshot | None = None) -> dict:
    door = SimpleNamespace(backend=StandInBackend(workers, planner), live=LiveWindow())
    return LiveView(door).document()  # type: ignore[arg-type]


def test_rates_and_prefix_hits_per_tier_come_from_the_workers_histories() -> None:
    prefill = view("prefill-0", "prefill", [(100.0, load(10, 1000, 0)), (101.0, load(12, 1100, 50)),
                                            (105.0, load(30, 1500, 500, from_host=10, remote=5))])
    decode = view("decode-0", "decode", [(100.0, load(0, 0, 0, received=0)), (104.0, load(40, 0, 0, received=8e6)),
                                         (105.0, load(50, 0, 0, received=10_000_000, reserved_blocks=4))])
    doc = document((prefill, decode))
    p, d = doc["workers"]
    assert p["steps_per_s"] == pytest.approx(20 / 5) and p["transfer_bytes_per_s"] == 0
    assert d["steps_per_s"] == pytest.approx(50 / 5) and d["transfer_bytes_per_s"] == pytest.approx(2e6)
    assert d["kv"]["device"] == {"used": 10, "free": 90, "reserved": 4, "total": 100}
    assert (p["tp"], d["tp"], d["kv_rank_bytes"]) == (1, 1, [])
    # Over the minute: 500 prompt tokens computed, 500 cached: 160 from host, 80 fetched, 260 device.
    hits = doc["cluster"]["prefix_hits"]
    assert hits == {"device": 0.26, "host": 0.16, "disk": 0.0, "remote": 0.08, "total": 0.5}
    assert doc["slo"] == {"ttft_ms": 2000.0, "tbt_ms": 150.0}


def test_no_history_yet_gives_zero_rates_and_no_hit_shares() -> None:
    only = view("prefill-0", "prefill", [(100.0, load(10, 1000, 0))])
    doc = document((only,))
    assert doc["workers"][0]["steps_per_s"] == 0.0
    assert doc["cluster"]["prefix_hits"]["total"] is None


def test_the_planner_timeline_has_wall_clock_times_and_only_the_newest_scores() -> None:
    """Decisions carry `time` (Unix s) from the planner's monotonic `at`; the split now, the desired
    one and the counts pass through; `planner` is null without a planner (off, co-located)."""
    assert document(())["planner"] is None
    now = time.monotonic()
    hold = Decision(now - 60, "hold", Split(1, 1), Split(1, 1), "1P1D serves the last window best",
                    scores={"1P1D": 2.0})
    flip = Decision(now - 30, "flip", Split(2, 2), Split(1, 3), "1P3D is predicted to serve +40% goodput",
                    "decode", 0.4, {"2P2D": 1.0, "1P3D": 1.4}, applied=True)
    doc = document((), PlannerSnapshot("act", 30.0, Split(1, 3), Split(1, 3), (hold, flip), {"hold": 1, "flip": 1}))
    p = doc["planner"]
    assert (p["mode"], p["split"], p["prefill"], p["decode"]) == ("act", "1P3D", 1, 3)
    assert p["desired"] == {"prefill": 1, "decode": 3} and p["counts"] == {"hold": 1, "flip": 1}
    first, last = p["decisions"]
    assert doc["now"] - last["time"] == pytest.approx(30, abs=1) and last["time"] - first["time"] == pytest.approx(30)
    assert (last["action"], last["current"], last["next"], last["gain"], last["applied"]) == \
        ("flip", "2P2D", "1P3D", 0.4, True)
    assert "scores" not in first and last["scores"] == {"2P2D": 1.0, "1P3D": 1.4}
