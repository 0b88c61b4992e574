"""Cluster-wide KV block index in Redis: which holder has which block, in which tier.

A *holder* is a worker (or a node-level arena) that stores KV blocks; it is named by a
`HolderId` and owns one `ClusterIndex`. Every verb is one Redis round trip per chunk of blocks,
made atomic by a small Lua script that reads the server's clock (so holders never compare clocks
with each other).

Data layout (namespace `ns`, default "hm"):

    ns:b:<hash16>           string  packed entries, 5 bytes each: holder num (u32 big endian) +
                                    tier mask (bit t = published in Tier t); one key per block
    ns:live                 zset    holder num -> heartbeat expiry (server ms)
    ns:names                hash    holder num -> "worker_id@node_id"
    ns:seq                  string  last holder num handed out (INCR)
    ns:epoch                string  random token of this Redis dataset (see index_link)
    ns:dead                 zset    expired holder nums whose entries still await the GC sweep
    ns:r:<num>              zset    tier byte + hash -> reservation expiry (ms); PEXPIRE'd
    ns:l:<holder key>:<hash16>  zset  lease token -> lease expiry (ms); PEXPIRE'd

A lookup is one EVALSHA: the script reads the live holders (ZRANGEBYSCORE on the server clock)
and the block keys (MGET, blocks 0-7 first since most misses end there), walks the chain once and
returns, per live holder, its prefix length and tiers. Python packs the command by hand (see
`kvpool.lua_scripts.PackedScript`): the hot path never goes through redis-py's generic packer.

Registration, incarnations, epochs and Redis outages are handled in `kvpool.index_link`; the Lua
scripts are package data under kvpool/lua/ (`kvpool.lua_scripts` loads and sends them).

Two-phase put: `reserve` (invisible to lookups, expires after `reservation_ttl_s`) -> the holder
writes the bytes -> `publish` (visible). Read leases are keyed by the holder's *name*, so they
outlive incarnations.

Faults: a Redis outage never raises out of a verb (except `acquire_lease`); lookups degrade to
an empty result and writes to the local record, re-published when Redis is back (details in
`kvpool.index_link`).

Tenant isolation by `cache_salt` needs nothing here: the salt is folded into block hash 0 of every
chain, so different salts give disjoint hashes and can never match each other's entries.
"""

from __future__ import annotations

import secrets
import struct
import threading
import time
from collections.abc import Iterable, Sequence

from redis.exceptions import RedisError

from halfmoon.kvpool.block_hash import HASH_BYTES, check_hashes
from halfmoon.kvpool.errors import BadBlockHashError
from halfmoon.kvpool.index_link import WRITE_CHUNK, IndexLink, chunks, logger
from halfmoon.kvpool.index_types import (
    BadHolderIdError,
    ClusterIndexError,
    HolderId,
    HolderMatch,
    IndexClosedError,
    IndexStats,
    IndexUnavailableError,
    LeaseId,
    LookupResult,
)
from halfmoon.kvpool.lua_scripts import resp_bulk
from halfmoon.kvpool.tiers import Tier

__all__ = [
    "ALL_TIERS_MASK",
    "BLOCK_HASH_BYTES",
    "BadBlockHashError",
    "BadHolderIdError",
    "ClusterIndex",
    "ClusterIndexError",
    "HolderId",
    "HolderMatch",
    "IndexClosedError",
    "IndexStats",
    "IndexUnavailableError",
    "LeaseId",
    "LookupResult",
    "check_hashes",
]

BLOCK_HASH_BYTES = HASH_BYTES
ALL_TIERS_MASK = sum(tier.bit for tier in Tier)
# Beats per heartbeat TTL: a holder expires only after this many beats in a row are missed.
HEARTBEATS_PER_TTL = 4
# Local reservations are purged of expired ones once the dict grows past this.
_RESERVATION_PURGE_AT = 4096
# Lookup reply records (see kvpool/lua/lookup.lua).
_MATCH_HEAD = struct.Struct(">H")
_MATCH_TAIL = struct.Struct(">IBIII")


class ClusterIndex(IndexLink):
    """This holder's handle on the cluster-wide block index (thread-safe).

    `lookup` never blocks on the write lock; writes (`reserve`, `publish`, `remove`, `move`)
    and re-synchronisation are serialised by one lock so a re-publish can't resurrect a block
    removed concurrently. Options: see `IndexLink`.
    """

    # ---------------------------------------------------------------- lookups

    def lookup(self, hashes: Sequence[bytes]) -> LookupResult:
        """Per live holder, how many leading blocks of the chain `hashes` it has published.

        One Redis round trip (one EVALSHA). Reserved-but-unpublished blocks and blocks of holders
        whose heartbeat expired are invisible. When Redis is unreachable the result is empty
        with `degraded=True`: the caller falls back to its local tiers.
        """
        blocks = check_hashes(hashes)
        self.stats.lookups += 1
        if not blocks:
            return LookupResult(0, ())
        return self._call("lookup", lambda: self._lookup_remote(blocks),
                          lambda: LookupResult(len(blocks), (), degraded=True))

    def _lookup_remote(self, blocks: list[bytes]) -> LookupResult:
        reply = self._lookup_call.run(self._pack_lookup(blocks))
        assert isinstance(reply, bytes), reply
        if not reply[0] and not self._stale:
            self._stale = True  # Redis lost this holder (restart/flush): next verb re-syncs
        if len(reply) == 1:
            return LookupResult(len(blocks), ())
        merged: dict[HolderId, HolderMatch] = {}
        for match in self._parse_matches(reply):
            known = merged.get(match.holder)  # two incarnations/processes of one holder
            if known is None or known.length < match.length:
                merged[match.holder] = match
        ranked = sorted(merged.values(), key=lambda m: (-m.length, m.tier, m.holder.key))
        return LookupResult(len(blocks), tuple(ranked))

    def _parse_matches(self, reply: bytes) -> Iterable[HolderMatch]:
        offset = 1
        while offset < len(reply):
            (name_len,) = _MATCH_HEAD.unpack_from(reply, offset)
            offset += _MATCH_HEAD.size
            holder = self._holder_named(reply[offset:offset + name_len])
            length, worst, n_dev, n_host, n_disk = _MATCH_TAIL.unpack_from(
                reply, offset + name_len)
            offset += name_len + _MATCH_TAIL.size
            yield HolderMatch(holder, length, Tier(worst), (n_dev, n_host, n_disk))

    def _pack_lookup(self, blocks: list[bytes]) -> bytes:
        """RESP of `EVALSHA sha numkeys epoch live names <blocks> epoch num`, in one join."""
        head = self._lookup_call.head(num_args=len(blocks) + 5, num_keys=len(blocks) + 3)
        return b"".join((head, self._lookup_fixed_keys, self._block_arg_head,
                         self._block_arg_sep.join(blocks), b"\r\n", resp_bulk(self._epoch),
                         resp_bulk(self._num_arg.encode())))

    def _holder_named(self, name: bytes) -> HolderId:
        holder = self._names.get(name)
        if holder is None:
            holder = self._names[name] = HolderId.from_key(name.decode())
        return holder

    def live_holders(self) -> set[HolderId]:
        """Holders whose heartbeat has not expired (empty when Redis is unreachable)."""
        return self._call("live_holders", self._live_remote, set)

    def _live_remote(self) -> set[HolderId]:
        names = self._live_script(keys=[self._live_key, self._names_key])
        return {self._holder_named(name) for name in names if name is not None}

    # ---------------------------------------------------------------- two-phase put

    def reserve(self, hashes: Sequence[bytes], tier: Tier) -> list[bytes]:
        """Mark this holder as writing `hashes` into `tier`; returns the ones newly reserved.

        A block is newly reserved unless this holder already published it in `tier` or holds
        an unexpired reservation for it there; the caller writes exactly the returned blocks,
        then `publish`es them. Reservations are invisible to lookups and expire after
        `reservation_ttl_s` if never published. Degraded: decided from the local record.
        """
        blocks = check_hashes(hashes)
        tier = Tier(tier)
        with self._lock:
            newly = self._call("reserve", lambda: self._reserve_remote(blocks, tier),
                               lambda: self._reserve_local(blocks, tier))
            self._remember_reservations(newly, tier)
        return newly

    def _reserve_remote(self, blocks: list[bytes], tier: Tier) -> list[bytes]:
        """Reserve in Redis; when the index lost this holder, re-sync and try once more."""
        for _ in range(2):
            newly = self._reservechunks(blocks, tier)
            if newly is not None:
                return newly
            self._stale = True
            if not self._ready("reserve"):
                break
        return self._reserve_local(blocks, tier)

    def _reservechunks(self, blocks: list[bytes], tier: Tier) -> list[bytes] | None:
        """Newly reserved blocks, or None when this holder's registration is gone."""
        newly: list[bytes] = []
        ttl_ms = int(self.settings.reservation_ttl_s * 1000)
        args = [self._epoch, self._packed_num, int(tier), ttl_ms, len(self._block_prefix)]
        for chunk in chunks(blocks, WRITE_CHUNK):
            keys = [self._epoch_key, self._reservations_key(),
                    *[self._block_prefix + h for h in chunk]]
            ok, *indexes = self._reserve_script(keys=keys, args=args)
            if not ok:
                return None
            newly += [chunk[i] for i in indexes]
        return newly

    def _reserve_local(self, blocks: list[bytes], tier: Tier) -> list[bytes]:
        now, held, newly = self._clock(), self._held[tier], []
        seen: set[bytes] = set()
        for h in blocks:
            if h not in held and h not in seen and self._reserving.get((tier, h), 0.0) <= now:
                newly.append(h)
            seen.add(h)
        return newly

    def _remember_reservations(self, newly: list[bytes], tier: Tier) -> None:
        now = self._clock()
        if len(self._reserving) > _RESERVATION_PURGE_AT:
            self._reserving = {k: t for k, t in self._reserving.items() if t > now}
        deadline = now + self.settings.reservation_ttl_s
        for h in newly:
            self._reserving[(tier, h)] = deadline

    def publish(self, hashes: Sequence[bytes], tier: Tier) -> None:
        """Make `hashes` visible as held by this holder in `tier` (ends their reservation).

        Publishing without a reservation is allowed (re-registration, a disk tier re-announcing
        what survived a restart). Degraded: remembered locally, published on reconnect.
        """
        blocks = check_hashes(hashes)
        tier = Tier(tier)
        with self._lock:
            self._held[tier].update(blocks)
            self._forget_reservations(blocks, tier.bit)
            self._write("publish", blocks, set_mask=tier.bit, clear_mask=0)

    def remove(self, hashes: Sequence[bytes], tier: Tier | None = None) -> None:
        """This holder no longer has `hashes` in `tier` (in any tier when `tier` is None).

        Also drops its reservations of them there. Degraded: remembered locally.
        """
        blocks = check_hashes(hashes)
        mask = ALL_TIERS_MASK if tier is None else Tier(tier).bit
        with self._lock:
            for t in Tier:
                if mask & t.bit:
                    self._held[t].difference_update(blocks)
            self._forget_reservations(blocks, mask)
            self._write("remove", blocks, set_mask=0, clear_mask=mask)

    def move(self, hashes: Sequence[bytes], from_tier: Tier, to_tier: Tier) -> None:
        """Atomically re-file `hashes` from `from_tier` to `to_tier` (demotion, promotion)."""
        blocks = check_hashes(hashes)
        src, dst = Tier(from_tier), Tier(to_tier)
        if src == dst:
            return
        with self._lock:
            self._held[src].difference_update(blocks)
            self._held[dst].update(blocks)
            self._forget_reservations(blocks, src.bit | dst.bit)
            self._write("move", blocks, set_mask=dst.bit, clear_mask=src.bit)

    def held(self, tier: Tier) -> frozenset[bytes]:
        """This holder's local record of the blocks it holds in `tier` (what it re-publishes)."""
        with self._lock:
            return frozenset(self._held[Tier(tier)])

    def _forget_reservations(self, blocks: list[bytes], mask: int) -> None:
        for t in Tier:
            if mask & t.bit:
                for h in blocks:
                    self._reserving.pop((t, h), None)

    def _write(self, verb: str, blocks: list[bytes], *, set_mask: int, clear_mask: int) -> None:
        """Send one write; when the index no longer has this holder live, re-sync instead
        (which re-publishes the local record, already updated by the caller)."""
        def remote() -> None:
            if not self._apply(blocks, set_mask, clear_mask):
                self._stale = True
                self._ready(verb)
        self._call(verb, remote, lambda: None)

    # ---------------------------------------------------------------- leases

    def acquire_lease(self, holder: HolderId, hashes: Sequence[bytes],
                      ttl_s: float) -> LeaseId:
        """Lease `hashes` at `holder` for reading: its evictor keeps them until the lease is
        released or `ttl_s` passes. Raises `IndexUnavailableError` when Redis is unreachable
        (the reader must not read remotely then) and `ValueError` for a bad `ttl_s`.
        """
        blocks = check_hashes(hashes)
        if not 0 < ttl_s <= self.settings.max_lease_ttl_s:
            raise ValueError(f"lease ttl_s must be in (0, {self.settings.max_lease_ttl_s}], got {ttl_s}")
        lease = LeaseId(secrets.token_hex(8), holder, tuple(blocks))
        keys = self._lease_keys(holder, blocks)

        def unavailable() -> None:
            raise IndexUnavailableError(f"cannot lease blocks at {holder.key}: Redis at "
                                        f"{self.url} is unreachable")
        self._call("acquire_lease",
                   lambda: self._acquire_script(keys=keys, args=[lease.token, int(ttl_s * 1000)]),
                   unavailable)
        return lease

    def release_lease(self, lease: LeaseId) -> None:
        """End `lease` (idempotent). Degraded: a no-op; the lease then ends at its TTL."""
        keys = self._lease_keys(lease.holder, list(lease.hashes))

        def remote() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.zrem(key, lease.token)
            pipe.execute()
        self._call("release_lease", remote, lambda: None)

    def leased(self, hashes: Sequence[bytes]) -> set[bytes]:
        """Which of `hashes` some reader currently leases at THIS holder (evict none of them).

        Whenever lease records may have been lost or can't be read (an outage, or Redis found
        to have restarted) every asked block counts as leased until `max_lease_ttl_s` has passed
        since: any lease taken before then has expired by that time.
        """
        blocks = check_hashes(hashes)
        if not blocks:
            return set()
        result = self._call("leased", lambda: self._leased_remote(blocks), set)
        if self._clock() < self._lease_blackout_until:
            return set(blocks)
        return result

    def _leased_remote(self, blocks: list[bytes]) -> set[bytes]:
        indexes = self._leased_script(keys=self._lease_keys(self.holder, blocks))
        return {blocks[i] for i in indexes}

    def _lease_keys(self, holder: HolderId, blocks: Sequence[bytes]) -> list[bytes]:
        prefix = f"{self._lease_prefix}{holder.key}:".encode()
        return [prefix + h for h in blocks]

    # ---------------------------------------------------------------- liveness

    def heartbeat(self) -> bool:
        """Extend this holder's liveness by `heartbeat_ttl_s`; True when it is live now.

        Finding itself expired or forgotten (Redis restarted) it re-registers and re-publishes.
        """
        def remote() -> bool:
            keys = [self._epoch_key, self._live_key, self._names_key, self._dead_key]
            args = [self._epoch, self._num_arg, int(self.settings.heartbeat_ttl_s * 1000)]
            if self._heartbeat_script(keys=keys, args=args):
                return True
            self._stale = True
            return self._ready("heartbeat")
        return self._call("heartbeat", remote, lambda: False)

    def start(self) -> ClusterIndex:
        """Start the background thread: heartbeat every `heartbeat_ttl_s / HEARTBEATS_PER_TTL`
        (`retry_interval_s` while Redis is unreachable; a beat may be late by several intervals under CPU load before the holder expires),
        plus a GC step. Its own thread: a busy engine or event loop never delays it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                            name=f"cluster-index-heartbeat[{self.holder.key}]")
            self._thread.start()
        return self

    def _beat_interval_s(self) -> float:
        """A beat per `heartbeat_ttl_s / HEARTBEATS_PER_TTL`; while Redis is unreachable, a probe
        per `retry_interval_s` (when shorter): the holder is back — re-registered, its blocks
        re-published, `healthy` again — within about that of Redis' return, whether or not a
        request touches the index (the soak saw 0.1-4.3 s after a Redis kill with beats alone)."""
        beat = self.settings.heartbeat_ttl_s / HEARTBEATS_PER_TTL
        return beat if self.healthy and not self._stale else min(beat, self.settings.retry_interval_s)

    def _heartbeat_loop(self) -> None:
        last = time.monotonic()
        while True:
            self._wake.wait(self._beat_interval_s())  # set by an outage (probe sooner) or a stop
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self.heartbeat():
                    now = time.monotonic()
                    self.stats.heartbeats += 1
                    self.stats.max_heartbeat_gap_s = max(self.stats.max_heartbeat_gap_s, now - last)
                    last = now
                    self.gc_step()
            except (RedisError, ClusterIndexError):
                # Outages are handled inside the verbs; this is a bug or a Redis refusal (OOM,
                # ACL): say so on every beat rather than let the thread die and the holder expire.
                logger.exception("cluster index: heartbeat of %s failed", self.holder.key)

    def stop_heartbeat(self) -> None:
        """Stop the background thread (the holder then expires after `heartbeat_ttl_s`)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stop.clear()

    def close(self) -> None:
        """Stop heartbeating and leave the index: this holder's entries vanish from lookups."""
        if self._closed:
            return
        self.stop_heartbeat()
        self._closed = True
        self._leave()

    def __enter__(self) -> ClusterIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def gc_step(self) -> int:
        """Sweep the next `gc_keys_per_step` block keys for dead holders' entries; returns how
        many were dropped. Idle unless some holder died; a full SCAN cycle retires the dead
        holders it started with."""
        if self.settings.gc_keys_per_step <= 0:
            return 0
        return self._call("gc", self._gc_remote, lambda: 0)

    def _gc_remote(self) -> int:
        if self._gc_cursor == 0:
            self._gc_dead = self._redis.zrange(self._dead_key, 0, -1)
            if not self._gc_dead:
                return 0
        cursor, keys = self._redis.scan(self._gc_cursor, match=self._block_prefix + b"*",
                                        count=self.settings.gc_keys_per_step)
        dropped = int(self._sweep_script(keys=[self._live_key, *keys])) if keys else 0
        self._gc_cursor = int(cursor)
        if self._gc_cursor == 0:
            self._redis.zrem(self._dead_key, *self._gc_dead)
        self.stats.gc_pruned += dropped
        return dropped
