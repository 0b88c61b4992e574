"""A holder's link to the cluster index in Redis: keys, scripts, registration, outages.

A holder num is one *incarnation* of a holder: registering (at start-up, after an outage, after
the holder expired or Redis lost its data) takes a fresh num, so entries of an old incarnation are
dead at once (filtered by every lookup) and are pruned lazily: by any write to the same block key
and by the background sweep (`gc_step`). Lookups therefore never see a dead holder's entry even
before it is collected. Nums restart at 1 when Redis loses its data, so every num-bearing verb
also checks `ns:epoch`: a holder still holding a num of an older epoch re-registers instead of
writing under a num that now names someone else.

Faults: a Redis outage never raises out of a verb (except `acquire_lease`, which cannot promise a
lease it could not record). The first failure of an outage logs one warning and flips `healthy`;
lookups then return an empty, `degraded` result; writes keep updating the local record of what
this holder holds; after the connection comes back (or after the index is found to have lost
this holder, e.g. a Redis restart between two commands) the holder re-registers and re-publishes
everything it holds. `IndexLink._call` is where every verb meets that policy.
"""

from __future__ import annotations

import logging
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from halfmoon.core.errors import check_positive
from halfmoon.kvpool.block_hash import HASH_BYTES
from halfmoon.kvpool.index_types import (
    ClusterIndexError,
    HolderId,
    IndexClosedError,
    IndexStats,
)
from halfmoon.kvpool.lua_scripts import PackedScript, resp_bulk, script_source
from halfmoon.kvpool.tiers import Tier

# One logger for the whole index (operators filter on it), whichever module logs.
logger = logging.getLogger("halfmoon.kvpool.cluster_index")

# Blocks per script call for writes: bounds how long one call blocks the Redis server.
WRITE_CHUNK = 4096
# Errors that mean "Redis is unreachable" (anything else from Redis is a bug and propagates).
OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError)
# Re-registrations tried when the holder expires again while re-publishing.
_RESYNC_ATTEMPTS = 3
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]+")

T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    """`items` in consecutive slices of at most `size`."""
    return (items[i:i + size] for i in range(0, len(items), size))


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """How a holder uses the index (validated here, once).

    namespace: prefix of every key (several clusters can share one Redis).
    heartbeat_ttl_s: a holder that stops heartbeating is dead after this (its entries filtered).
    reservation_ttl_s: a two-phase put's reservation expires after this unless published.
    max_lease_ttl_s: the longest read lease a reader may take.
    retry_interval_s: while Redis is unreachable, how often to try again.
    gc_keys_per_step: block keys the background sweep visits per step.
    """

    namespace: str = "hm"
    heartbeat_ttl_s: float = 10.0
    reservation_ttl_s: float = 30.0
    max_lease_ttl_s: float = 30.0
    retry_interval_s: float = 1.0
    gc_keys_per_step: int = 1000

    def __post_init__(self) -> None:
        if not _NAMESPACE_RE.fullmatch(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must match {_NAMESPACE_RE.pattern}")
        check_positive(self, "heartbeat_ttl_s", "reservation_ttl_s", "max_lease_ttl_s", error=ValueError)


class IndexLink:
    """Registration and fault handling of one holder; `ClusterIndex` adds the verbs.

    `clock` (monotonic seconds) times what this process decides alone: the retry back-off, the
    lease blackout after an outage, local reservations while degraded. Expiries the index
    decides (heartbeats, reservations, leases) run on the Redis server's clock.
    """

    def __init__(self, url: str, holder: HolderId, *, socket_timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, **settings: Any) -> None:
        """`settings`: the fields of `IndexSettings` (its defaults otherwise)."""
        self.url = url
        self.holder = holder
        self.settings = IndexSettings(**settings)
        self.stats = IndexStats()
        self._clock = clock
        self.healthy = True
        self._init_keys(self.settings.namespace)
        self._init_client(url, socket_timeout_s)
        self._init_state()
        self._ready("register")

    def _init_keys(self, ns: str) -> None:
        self._block_prefix = f"{ns}:b:".encode()
        self._live_key = f"{ns}:live"
        self._names_key = f"{ns}:names"
        self._seq_key = f"{ns}:seq"
        self._dead_key = f"{ns}:dead"
        self._epoch_key = f"{ns}:epoch"
        self._lease_prefix = f"{ns}:l:"
        # Pre-packed RESP pieces of the lookup command (see `_pack_lookup`).
        self._lookup_fixed_keys = b"".join(resp_bulk(k.encode())
                                           for k in (self._epoch_key, self._live_key,
                                                     self._names_key))
        self._block_arg_head = b"$%d\r\n%s" % (len(self._block_prefix) + HASH_BYTES,
                                                self._block_prefix)
        self._block_arg_sep = b"\r\n" + self._block_arg_head

    def _init_client(self, url: str, socket_timeout_s: float) -> None:
        # No client-side retries: an outage must surface at once so the verb can degrade; the
        # next call reconnects by itself.
        self._redis = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=min(socket_timeout_s, 1.0),
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        script = self._redis.register_script
        self._lookup_call = PackedScript(script_source("lookup"), self._redis)
        self._apply_script = script(script_source("apply"))
        self._reserve_script = script(script_source("reserve"))
        self._register_script = script(script_source("register"))
        self._heartbeat_script = script(script_source("heartbeat"))
        self._live_script = script(script_source("live"))
        self._sweep_script = script(script_source("sweep"))
        self._acquire_script = script(script_source("acquire_lease"))
        self._leased_script = script(script_source("leased"))

    def _init_state(self) -> None:
        self._num: int | None = None  # this incarnation's holder num; None before registering
        self._num_arg = ""
        self._packed_num = b""
        self._epoch = b""  # the Redis dataset generation `_num` belongs to
        self._stale = True  # the index may lack this holder's blocks: re-register + republish
        self._registered_once = False
        self._next_probe = 0.0  # monotonic time before which an unhealthy index stays offline
        self._lease_blackout_until = 0.0  # see `leased`
        self._lock = threading.RLock()
        self._held: dict[Tier, set[bytes]] = {tier: set() for tier in Tier}
        self._reserving: dict[tuple[Tier, bytes], float] = {}  # local mirror, monotonic deadline
        self._names: dict[bytes, HolderId] = {}
        self._gc_cursor = 0
        self._gc_dead: list[bytes] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # the heartbeat thread's: a stop, or an outage to probe
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---------------------------------------------------------------- fault handling

    def _call(self, verb: str, remote: Callable[[], T], degraded: Callable[[], T]) -> T:
        """`remote()` against Redis, or `degraded()` when Redis is (or just went) unreachable."""
        if not self._ready(verb):
            self.stats.degraded_calls += 1
            return degraded()
        try:
            return remote()
        except OUTAGE_ERRORS as err:
            self._on_outage(verb, err)
            return degraded()

    def _ready(self, verb: str) -> bool:
        """True when Redis can be used now; re-syncs first if the index may lack our blocks."""
        if self._closed:
            raise IndexClosedError(f"{verb} on a closed ClusterIndex ({self.holder.key})")
        if self.healthy and not self._stale:
            return True
        if not self.healthy and self._clock() < self._next_probe:
            return False
        return self._resync(verb)

    def _resync(self, verb: str) -> bool:
        """Register a fresh incarnation and re-publish every block held (under the lock)."""
        with self._lock:
            if self.healthy and not self._stale:
                return True  # another thread just did it
            try:
                republished = self._register_and_republish()
            except OUTAGE_ERRORS as err:
                self._on_outage(verb, err)
                return False
            self._log_resync(verb, republished)
            self._registered_once = True
            self.healthy, self._stale = True, False
            return True

    def _register_and_republish(self) -> int:
        """Take a fresh holder num and publish the local record under it; returns its size."""
        for _ in range(_RESYNC_ATTEMPTS):
            self._register()
            republished = 0
            for tier in Tier:
                blocks = sorted(self._held[tier])
                if blocks and not self._apply(blocks, tier.bit, 0):
                    break  # expired while re-publishing: start over with a fresh num
                republished += len(blocks)
            else:
                if self._registered_once:
                    self.stats.resyncs += 1
                    self.stats.republished_blocks += republished
                return republished
        raise ClusterIndexError(
            f"{self.holder.key} expired {_RESYNC_ATTEMPTS} times while re-publishing "
            f"{sum(map(len, self._held.values()))} blocks: heartbeat_ttl_s="
            f"{self.settings.heartbeat_ttl_s} is too short for that")

    def _register(self) -> None:
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        epoch, num = self._register_script(
            keys=[self._epoch_key, self._seq_key, self._names_key, self._live_key,
                  self._dead_key],
            args=[secrets.token_hex(8), self.holder.key, self._epoch, self._num_arg, ttl_ms])
        if self._epoch and epoch != self._epoch:
            # Redis lost its data (restart, flush): lease records taken before are gone too.
            self._lease_blackout_until = max(self._lease_blackout_until,
                                             self._clock() + self.settings.max_lease_ttl_s)
        self._epoch, self._num = epoch, int(num)
        self._num_arg, self._packed_num = str(self._num), struct.pack(">I", self._num)

    def _log_resync(self, verb: str, republished: int) -> None:
        if not self._registered_once:
            logger.debug("cluster index: %s registered at %s as num %d", self.holder.key,
                         self.url, self._num)
        elif not self.healthy:
            logger.warning("cluster index: Redis at %s is reachable again (noticed by %s); %s "
                           "re-registered as num %d and re-published %d blocks", self.url, verb,
                           self.holder.key, self._num, republished)
        else:
            logger.warning("cluster index: Redis at %s had lost holder %s (restart or expired "
                           "heartbeat, noticed by %s); re-registered as num %d and re-published "
                           "%d blocks", self.url, self.holder.key, verb, self._num, republished)

    def _on_outage(self, verb: str, err: Exception) -> None:
        with self._lock:
            self.stats.redis_errors += 1
            self._next_probe = self._clock() + self.settings.retry_interval_s
            if not self.healthy:
                return
            self.healthy = False
            self._stale = True
            self._lease_blackout_until = self._clock() + self.settings.max_lease_ttl_s
            self._wake.set()  # the heartbeat thread now probes every retry_interval_s
        logger.warning("cluster index: Redis at %s is unreachable (%s failed: %s: %s); holder "
                       "%s degrades to local-only lookups and re-publishes its blocks when Redis "
                       "is back", self.url, verb, type(err).__name__, err, self.holder.key)

    def _apply(self, blocks: Sequence[bytes], set_mask: int, clear_mask: int) -> bool:
        """Apply the tier bits to every block, chunked; False if this num is not live."""
        prefix = self._block_prefix
        args = [self._epoch, self._num_arg, self._packed_num, set_mask, clear_mask, len(prefix)]
        for chunk in chunks(blocks, WRITE_CHUNK):
            keys = [self._epoch_key, self._live_key, self._reservations_key(),
                    *[prefix + h for h in chunk]]
            if not self._apply_script(keys=keys, args=args):
                return False
        return True

    def _reservations_key(self) -> str:
        return f"{self.settings.namespace}:r:{self._num_arg}"

    def _leave(self) -> None:
        """Deregister (entries vanish from lookups at once) and drop the connections."""
        if self.healthy and self._num is not None:
            try:
                self._deregister()
            except OUTAGE_ERRORS as err:
                logger.info("cluster index: could not deregister %s from %s (%s); its entries "
                            "expire with its heartbeat", self.holder.key, self.url, err)
        self._lookup_call.close()
        self._redis.close()

    def _deregister(self) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.zrem(self._live_key, self._num_arg)
        pipe.hdel(self._names_key, self._num_arg)
        pipe.zadd(self._dead_key, {self._num_arg: 0})
        pipe.execute()
