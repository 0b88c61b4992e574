"""A worker that can serve either role (`--planner act`, issue 49): one engine with both the
prefill worker's KV senders and the decode worker's receiver and reservations, so the planner
flips its role without a restart: the Conductor drains it, `become` sets the engine's prefill
slots for the new role, and it re-registers with the other pool. Its engine, prefix cache and
tiers stay: what it computed stays a cache hit through the cluster index.

    worker = FlexWorker(spec)               # serves spec.role's verbs first
    await worker.become("decode", None)     # drained by the Conductor first

Both roles' verbs are always answered (the Conductor sends a worker only its pool's); the load
it reports is the decode worker's with the prefill worker's pending prompt tokens.
"""

from __future__ import annotations

from dataclasses import replace

from halfmoon.core.errors import ConfigError
from halfmoon.core.messages import WorkerLoad
from halfmoon.decode_worker.worker import DecodeWorker
from halfmoon.prefill_worker.worker import PrefillWorker

ROLES = ("prefill", "decode")


class FlexWorker(PrefillWorker, DecodeWorker):
    """Prefill and decode verbs over one engine (module docstring). MRO: PrefillWorker ->
    DecodeWorker -> EngineWorker, each `__init__` once."""

    async def become(self, role: str, max_prefill_seqs: int | None) -> None:
        """Serve `role` from now on: the engine steps at most `max_prefill_seqs` prompts at once
        (a prefill worker's limit, or the decode worker's)."""
        if role not in ROLES:
            raise ConfigError(f"a worker's role is one of {ROLES}, got {role!r}")

        def switch() -> None:
            self.engine.scheduler.max_prefill_seqs = max_prefill_seqs

        await self.on_engine(switch)
        self.spec = replace(self.spec, role=role, engine=replace(self.spec.engine, max_prefill_seqs=max_prefill_seqs))

    async def load(self) -> WorkerLoad:
        return replace(await DecodeWorker.load(self), pending_tokens=self.pending_tokens)

    def close(self) -> None:
        self.peers.close()
        DecodeWorker.close(self)
