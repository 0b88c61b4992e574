"""`GET /dashboard/api/live`: the backend's snapshot (workers and their last health answers) and
the front door's recent history (conductor/live.py) as one JSON document (docs/DASHBOARD.md).

Rates (steps/s, KV bytes/s) and the prefix-hit shares per tier are differences of the workers'
counters between health answers (the Conductor keeps the last ~90 s of them per worker):
`RATE_S` for rates, `HITS_S` for hit shares.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from halfmoon.conductor.backend import BackendStats, WorkerView
from halfmoon.api.frontdoor import FrontDoor
from halfmoon.core.messages import WorkerLoad
from halfmoon.dashboard.jsonable import finite

RATE_S = 5.0
HITS_S = 60.0
HISTORY = 256  # answers kept per worker (one a second: ~4 minutes)
TIERS = ("device", "host", "disk", "remote")


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    load: WorkerLoad


class LiveView:
    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self._history: dict[str, deque[_Sample]] = {}

    def document(self) -> dict[str, Any]:
        door, backend = self.door, self.door.backend
        stats = backend.stats()
        self._remember(stats.workers)
        snap = door.live.snapshot()
        config = backend.admission_config
        classes = config.classes()
        default = classes[config.default_class]
        s = snap.series
        return finite({
            "now": time.time(), "model": backend.model.id, "model_info": {
                "architecture": backend.model.architecture, "dtype": backend.model.dtype,
                "max_model_len": backend.model.max_model_len}, "mode": backend.mode, "ready": backend.ready(),
            "admission": {"policy": config.admission, "default_class": config.default_class,
                          "classes": {c.name: {"ttft_ms": c.ttft_ms, "tbt_ms": c.tbt_ms} for c in classes.values()}},
            "slo": {"ttft_ms": default.ttft_ms, "tbt_ms": default.tbt_ms},
            "workers": [self._worker(w) for w in stats.workers],
            "cluster": {"requests_running": stats.requests_running, "requests_waiting": stats.requests_waiting,
                        "request_rate": round(snap.request_rate, 4), "goodput_rps": round(snap.goodput_rps, 4),
                        "slo_attainment": snap.slo_attainment, "finished": snap.finished,
                        "rejected": snap.rejected, "errors": snap.errors,
                        "prefix_hits": self._hits(stats, backend.block_size)},
            "series": {"bin_s": s.bin_s, "t": s.t, "request_rate": s.request_rate, "goodput_rps": s.goodput_rps,
                       "rejected_rps": s.rejected_rps, "ttft_ms": s.ttft_ms, "tbt_ms": s.tbt_ms},
            "lora": self._lora(stats),
            "planner": _planner(stats),
        })

    def _lora(self, stats: BackendStats) -> dict[str, Any] | None:
        """The adapters served (or once served): requests, rank, and the workers holding each
        (in a slot or their host cache); None when the server serves none and never did."""
        if stats.lora is None or not (stats.lora.loaded or stats.lora.requests):
            return None
        registry = self.door.backend.adapters
        if registry is None:
            return None
        requests = dict(stats.lora.requests)
        held: dict[str, list[str]] = {}
        for w in stats.workers:
            for digest in (w.load.adapters if w.load is not None else ()):
                held.setdefault(digest, []).append(w.worker_id)
        loaded = {a.name: a for a in registry.list()}
        names = sorted(set(loaded) | set(requests))
        rows = [{"name": n, "loaded": n in loaded, "requests": requests.get(n, 0),
                 "rank": loaded[n].rank if n in loaded else None,
                 "held_by": held.get(loaded[n].digest, []) if n in loaded else []} for n in names]
        return {"adapters": rows, "loads": stats.lora.loads, "unloads": stats.lora.unloads}

    # ------------------------------------------------------------------ workers

    def _remember(self, workers: tuple[WorkerView, ...]) -> None:
        """The workers' recent answers: the Conductor's own history of them where it keeps one
        (the cluster's health loop, every second whether or not anyone looks), else what this
        view sampled at each request (the co-located engine)."""
        for w in workers:
            if w.history:
                self._history[w.worker_id] = deque((_Sample(at, load) for at, load in w.history), maxlen=HISTORY)
                continue
            if w.load is None:
                continue
            history = self._history.setdefault(w.worker_id, deque(maxlen=HISTORY))
            if not history or history[-1].at != w.at:
                history.append(_Sample(w.at, w.load))

    def _since(self, worker_id: str, seconds: float) -> tuple[_Sample, _Sample] | None:
        """The oldest answer within `seconds` of the newest, and the newest (None: fewer than 2)."""
        history = self._history.get(worker_id)
        if not history or len(history) < 2:
            return None
        newest = history[-1]
        oldest = next((s for s in history if s.at >= newest.at - seconds), newest)
        return (oldest, newest) if oldest is not newest else (history[-2], newest)

    def _worker(self, w: WorkerView) -> dict[str, Any]:
        load = w.load
        out: dict[str, Any] = {"id": w.worker_id, "role": w.role, "state": w.state, "pid": w.pid,
                               "alive": w.alive, "restarts": w.restarts,
                               "queue_depth": w.queue_depth, "running": 0, "steps": 0, "steps_per_s": 0.0,
                               "kv": {"device": None, "host": None, "disk": None}, "transfer_bytes_per_s": 0.0,
                               "prompt_tokens_computed": 0, "prompt_tokens_cached": 0,
                               "speculation": None, "tp": 1, "kv_rank_bytes": [], "lora": None}
        if load is None:
            return out
        used = load.total_blocks - load.free_blocks
        out.update(running=load.running, steps=load.steps, prompt_tokens_computed=load.prompt_tokens_computed,
                   prompt_tokens_cached=load.prompt_tokens_cached, tp=load.tp,
                   kv_rank_bytes=list(load.kv_rank_bytes))  # a tensor-parallel worker: one unit of tp ranks
        if load.spec_verifications:  # since start: acceptance and tokens per verification
            out["speculation"] = {"acceptance": round(load.spec_accepted / max(load.spec_proposed, 1), 4),
                                  "tokens_per_step": round(load.spec_emitted / load.spec_verifications, 3),
                                  "proposed": load.spec_proposed, "accepted": load.spec_accepted}
        if load.lora is not None:  # its LoRA slots since start
            c = load.lora
            out["lora"] = {"disk_loads": c.disk_loads, "page_ins": c.page_ins, "evictions": c.evictions,
                           "hits": c.hits, "hit_rate": round(c.hits / max(c.hits + c.page_ins, 1), 4)}
        out["kv"] = {"device": {"used": used, "free": load.free_blocks, "reserved": load.reserved_blocks,
                                "total": load.total_blocks},
                     "host": _tier(load.host_blocks_used, load.host_blocks_total),
                     "disk": _tier(load.disk_blocks_used, load.disk_blocks_total)}
        pair = self._since(w.worker_id, RATE_S)
        if pair is not None:
            (a, b), dt = pair, max(pair[1].at - pair[0].at, 1e-6)
            out["steps_per_s"] = round((b.load.steps - a.load.steps) / dt, 3)
            out["transfer_bytes_per_s"] = round((b.load.kv_bytes_received - a.load.kv_bytes_received) / dt, 1)
        return out

    def _hits(self, stats: BackendStats, block_size: int) -> dict[str, float | None]:
        """Prompt tokens served from each tier over prompt tokens, over the last minute, summed over
        the workers that compute prompts (prefill, co-located)."""
        got = dict.fromkeys(TIERS, 0)
        prompt = 0
        for w in stats.workers:
            pair = self._since(w.worker_id, HITS_S) if w.role != "decode" else None
            if pair is None:
                continue
            a, b = pair[0].load, pair[1].load
            cached = b.prompt_tokens_cached - a.prompt_tokens_cached
            prompt += cached + b.prompt_tokens_computed - a.prompt_tokens_computed
            lower = {"host": (b.blocks_from_host - a.blocks_from_host) * block_size,
                     "disk": (b.blocks_from_disk - a.blocks_from_disk) * block_size,
                     "remote": (b.blocks_fetched_remote - a.blocks_fetched_remote) * block_size}
            for tier, tokens in lower.items():
                got[tier] += tokens
            got["device"] += max(0, cached - sum(lower.values()))
        if prompt <= 0:
            return {**dict.fromkeys(TIERS), "total": None}
        shares = {tier: round(tokens / prompt, 4) for tier, tokens in got.items()}
        return {**shares, "total": round(sum(got.values()) / prompt, 4)}


def _planner(stats: BackendStats) -> dict[str, Any] | None:
    """The planner's mode, split now and desired, counts, and its decisions (oldest first) each
    with `time` (Unix s) besides `at` (the planner's clock: the Conductor's monotonic one); each
    split's scores are left out but the newest decision's (the timeline shows no more)."""
    if stats.planner is None:
        return None
    out = stats.planner.view()
    offset = time.time() - time.monotonic()
    decisions = out["decisions"]
    assert isinstance(decisions, list)
    for i, d in enumerate(decisions):
        d["time"] = d["at"] + offset
        if i < len(decisions) - 1:
            del d["scores"]
    return out


def _tier(used: int, total: int) -> dict[str, int] | None:
    return {"used": used, "free": total - used, "total": total} if total else None
