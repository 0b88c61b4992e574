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
    ns:epoch                string  random token of this Redis dataset (see below)
    ns:dead                 zset    expired holder nums whose entries still await the GC sweep
    ns:r:<num>              zset    tier byte + hash -> reservation expiry (ms); PEXPIRE'd
    ns:l:<holder key>:<hash16>  zset  lease token -> lease expiry (ms); PEXPIRE'd

A lookup is one EVALSHA: the script reads the live holders (ZRANGEBYSCORE on the server clock)
and the block keys (MGET, blocks 0-7 first since most misses end there), walks the chain once and
returns, per live holder, its prefix length and tiers. Python packs the command by hand (see
`_PackedScript`): the hot path never goes through redis-py's generic packer.

A holder num is one *incarnation* of a holder: registering (at start-up, after an outage, after
the holder expired or Redis lost its data) takes a fresh num, so entries of an old incarnation are
dead at once (filtered by every lookup) and are pruned lazily: by any write to the same block key
and by the background sweep (`gc_step`). Lookups therefore never see a dead holder's entry even
before it is collected. Nums restart at 1 when Redis loses its data, so every num-bearing verb
also checks `ns:epoch`: a holder still holding a num of an older epoch re-registers instead of
writing under a num that now names someone else.

Two-phase put: `reserve` (invisible to lookups, expires after `reservation_ttl_s`) -> the holder
writes the bytes -> `publish` (visible). Read leases are keyed by the holder's *name*, so they
outlive incarnations.

Faults: a Redis outage never raises out of a verb (except `acquire_lease`, which cannot promise a
lease it could not record). The first failure of an outage logs one warning and flips `healthy`;
lookups then return an empty, `degraded` result; writes keep updating the local record of what
this holder holds; after the connection comes back (or after the index is found to have lost
this holder, e.g. a Redis restart between two commands) the holder re-registers and re-publishes
everything it holds.

Tenant isolation by `cache_salt` needs nothing here: the salt is folded into block hash 0 of every
chain, so different salts give disjoint hashes and can never match each other's entries.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvpool.errors import KVPoolError
from kvpool.tiers import Tier

logger = logging.getLogger(__name__)

BLOCK_HASH_BYTES = 16
ALL_TIERS_MASK = sum(tier.bit for tier in Tier)
# Blocks per script call for writes: bounds how long one call blocks the Redis server.
WRITE_CHUNK = 4096
# Errors that mean "Redis is unreachable" (anything else from Redis is a bug and propagates).
_OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError)
# Local reservations are purged of expired ones once the dict grows past this.
_RESERVATION_PURGE_AT = 4096
# Lookup reply records (see `_LOOKUP_LUA`).
_MATCH_HEAD = struct.Struct(">H")
_MATCH_TAIL = struct.Struct(">IBIII")
# Re-registrations tried when the holder expires again while re-publishing.
_RESYNC_ATTEMPTS = 3
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]+")

T = TypeVar("T")


class ClusterIndexError(KVPoolError):
    """Base of the cluster index's own errors."""


class BadBlockHashError(ClusterIndexError, ValueError):
    """A block hash that is not `bytes` of length `BLOCK_HASH_BYTES`."""


class BadHolderIdError(ClusterIndexError, ValueError):
    """A `HolderId` with an empty field, or an '@' in its worker id."""


class IndexUnavailableError(ClusterIndexError):
    """Redis is unreachable and the verb cannot degrade (a lease cannot be promised)."""


class IndexClosedError(ClusterIndexError):
    """A verb was called after `close()`."""


@dataclass(frozen=True, slots=True)
class HolderId:
    """A holder of KV blocks: one worker on one node."""

    worker_id: str
    node_id: str

    def __post_init__(self) -> None:
        if not self.worker_id or not self.node_id:
            raise BadHolderIdError(f"empty worker_id or node_id in {self!r}")
        if "@" in self.worker_id:
            raise BadHolderIdError(f"worker_id {self.worker_id!r} must not contain '@'")

    @property
    def key(self) -> str:
        """The holder's name in Redis, `worker_id@node_id`."""
        return f"{self.worker_id}@{self.node_id}"

    @classmethod
    def from_key(cls, key: str) -> HolderId:
        worker_id, _, node_id = key.partition("@")
        return cls(worker_id, node_id)


class HolderMatch(NamedTuple):
    """How much of a prompt's block chain one holder has."""

    holder: HolderId
    length: int  # leading blocks held (blocks 0..length-1), published and holder alive
    tier: Tier  # slowest tier a reader of the whole prefix touches (max over blocks of best tier)
    blocks_per_tier: tuple[int, int, int]  # matched blocks whose best tier is DEVICE, HOST, DISK


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Per-holder prefix matches of one lookup, longest first (ties: faster tier, then name)."""

    num_blocks: int
    matches: tuple[HolderMatch, ...]
    degraded: bool = False  # True when Redis was unreachable: the result is empty, not a miss

    @property
    def best(self) -> HolderMatch | None:
        """The holder with the longest prefix, or None when nobody has block 0."""
        return self.matches[0] if self.matches else None

    def match(self, holder: HolderId) -> HolderMatch | None:
        """`holder`'s match, or None when it does not have block 0."""
        return next((m for m in self.matches if m.holder == holder), None)

    def match_len(self, holder: HolderId) -> int:
        """Number of leading blocks `holder` has (0 when none)."""
        found = self.match(holder)
        return found.length if found is not None else 0


@dataclass(frozen=True, slots=True)
class LeaseId:
    """A read lease on `hashes` at `holder`; carries what `release_lease` needs."""

    token: str
    holder: HolderId
    hashes: tuple[bytes, ...]


@dataclass(slots=True)
class IndexStats:
    """Counters of one `ClusterIndex` (exported as metrics by the worker)."""

    lookups: int = 0
    redis_errors: int = 0  # failed Redis calls (every one, not once per outage)
    degraded_calls: int = 0  # verbs answered locally without trying Redis (retry back-off)
    resyncs: int = 0  # re-registrations that re-published this holder's blocks
    republished_blocks: int = 0
    gc_pruned: int = 0  # dead holders' entries removed by this holder's sweep


# Every script gets the server clock in ms as `now`.
_LUA_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# `alive(id)`: is holder num `id` live (expiry > now)? Cached per script call. Needs `live_key`.
_LUA_ALIVE = """
local alive_cache = {}
local function alive(id)
  local known = alive_cache[id]
  if known == nil then
    local score = redis.call('ZSCORE', live_key, id)
    known = score ~= false and tonumber(score) > now
    alive_cache[id] = known
  end
  return known
end
"""

# KEYS: epoch, live, names, block keys in chain order. ARGV: own epoch, own num ('' if none).
# Returns one string (a bulk reply parses far faster than a nested array in redis-py):
#   own_ok: u8 (0 when the caller's registration is gone: Redis restarted or flushed, or expired)
#   per matching holder: name length u16, name, length u32, worst tier u8, n_device u32,
#   n_host u32, n_disk u32 (all big endian; the layout of `_MATCH_HEAD` and `_MATCH_TAIL`).
_LOOKUP_LUA = _LUA_NOW + """
local tier_of = {0, 1, 0, 2, 0, 1, 0}  -- tier mask -> best tier in it
local live = {}  -- holder num -> {prefix length, worst tier, n_device, n_host, n_disk}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')) do
  live[tonumber(m)] = {0, 0, 0, 0, 0}
end
-- A first small MGET: most misses end at block 0.
local n, i, going, batch = #KEYS - 3, 0, true, 8
while going and i < n do
  local vals = redis.call('MGET', unpack(KEYS, i + 4, math.min(i + batch, n) + 3))
  batch = 256
  for j = 1, #vals do
    i = i + 1
    local v, advanced = vals[j], false
    if v then
      for off = 1, #v, 5 do
        local a, b, c, d, m = string.byte(v, off, off + 4)
        local st = live[((a * 256 + b) * 256 + c) * 256 + d]
        if st and st[1] == i - 1 then
          local tier = tier_of[m]
          st[1] = i
          if tier > st[2] then st[2] = tier end
          st[3 + tier] = st[3 + tier] + 1
          advanced = true
        end
      end
    end
    if not advanced then going = false; break end
  end
end
local own = tonumber(ARGV[2])
local own_ok = redis.call('GET', KEYS[1]) == ARGV[1] and own and live[own]
local out = {own_ok and '\\1' or '\\0'}
for id, st in pairs(live) do
  if st[1] > 0 then
    local name = redis.call('HGET', KEYS[3], id)
    if name then
      out[#out + 1] = struct.pack('>H', #name) .. name ..
                      struct.pack('>I4BI4I4I4', st[1], st[2], st[3], st[4], st[5])
    end
  end
end
return table.concat(out)
"""

# KEYS: epoch, live, own reservations, block keys. ARGV: own epoch, own num, own packed num,
# set mask, clear mask, block key prefix length. Sets/clears own tier bits, drops dead holders'
# entries, ends the reservations of every touched tier. Returns 0 (nothing written) when the
# caller's registration is gone.
_APPLY_LUA = _LUA_NOW + "local live_key = KEYS[2]\n" + _LUA_ALIVE + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or not alive(ARGV[2]) then return 0 end
local own, setm, clr = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local plen, touched = tonumber(ARGV[6]), bit.bor(setm, clr)
local has_rsv = redis.call('EXISTS', KEYS[3]) == 1
for k = 4, #KEYS do
  local key = KEYS[k]
  local v = redis.call('GET', key) or ''
  local parts, mine = {}, 0
  for off = 1, #v, 5 do
    local head = string.sub(v, off, off + 3)
    if head == own then
      mine = string.byte(v, off + 4)
    else
      local a, b, c, d = string.byte(head, 1, 4)
      if alive(((a * 256 + b) * 256 + c) * 256 + d) then
        parts[#parts + 1] = string.sub(v, off, off + 4)
      end
    end
  end
  mine = bit.bor(bit.band(mine, bit.bnot(clr)), setm)
  if mine ~= 0 then parts[#parts + 1] = own .. string.char(mine) end
  local nv = table.concat(parts)
  if nv == '' then redis.call('DEL', key) elseif nv ~= v then redis.call('SET', key, nv) end
  if has_rsv then
    local h = string.sub(key, plen + 1)
    for tier = 0, 2 do
      if bit.band(touched, 2 ^ tier) ~= 0 then
        redis.call('ZREM', KEYS[3], string.char(tier) .. h)
      end
    end
  end
end
return 1
"""

# KEYS: epoch, own reservations, block keys. ARGV: own epoch, own packed num, tier, ttl ms, block
# key prefix length. Returns {1, 0-based indexes of blocks newly reserved} (not published in
# `tier` by this holder, not under a live reservation of it), or {0} when the caller's
# registration is gone.
_RESERVE_LUA = _LUA_NOW + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local own, tier, ttl, plen = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {1}
for k = 3, #KEYS do
  local v, held = redis.call('GET', KEYS[k]) or '', false
  for off = 1, #v, 5 do
    if string.sub(v, off, off + 3) == own then
      held = bit.band(string.byte(v, off + 4), 2 ^ tier) ~= 0
      break
    end
  end
  local member = string.char(tier) .. string.sub(KEYS[k], plen + 1)
  if not held and not redis.call('ZSCORE', KEYS[2], member) then
    redis.call('ZADD', KEYS[2], now + ttl, member)
    out[#out + 1] = k - 3
  end
end
if #out > 1 and redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
return out
"""

# KEYS: epoch, seq, names, live, dead. ARGV: epoch to create if none, holder key, old epoch, old
# num ('' if none), ttl ms. Nums are unique within an epoch; the epoch changes when Redis loses
# its data, so a num of an older epoch is never mistaken for the current holder of that num.
# Retires the old num when it is of this epoch. Returns {epoch, new num}.
_REGISTER_LUA = _LUA_NOW + """
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  epoch = ARGV[1]
  redis.call('SET', KEYS[1], epoch)
end
local num = redis.call('INCR', KEYS[2])
if num >= 4294967296 then return redis.error_reply('holder nums exhausted (u32)') end
redis.call('HSET', KEYS[3], num, ARGV[2])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), num)
if ARGV[4] ~= '' and ARGV[3] == epoch then
  redis.call('ZREM', KEYS[4], ARGV[4])
  redis.call('HDEL', KEYS[3], ARGV[4])
  redis.call('ZADD', KEYS[5], now, ARGV[4])
end
return {epoch, num}
"""

# KEYS: epoch, live, names, dead. ARGV: own epoch, own num, ttl ms. Moves every expired holder to
# `dead`, then extends own expiry. Returns 1, or 0 when the caller's registration is gone.
_HEARTBEAT_LUA = _LUA_NOW + """
local score = redis.call('ZSCORE', KEYS[2], ARGV[2])
local ok = redis.call('GET', KEYS[1]) == ARGV[1] and score ~= false and tonumber(score) > now
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
  redis.call('ZADD', KEYS[4], now, m)
end
if not ok then return 0 end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
return 1
"""

# KEYS: live, names. Returns the names of live holders.
_LIVE_LUA = _LUA_NOW + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[2], unpack(ids))
"""

# KEYS: live, block keys. Drops entries of holders that are not live. Returns entries dropped.
_SWEEP_LUA = _LUA_NOW + "local live_key = KEYS[1]\n" + _LUA_ALIVE + """
local dropped = 0
for k = 2, #KEYS do
  local v = redis.call('GET', KEYS[k])
  if v then
    local parts = {}
    for off = 1, #v, 5 do
      local a, b, c, d = string.byte(v, off, off + 3)
      if alive(((a * 256 + b) * 256 + c) * 256 + d) then
        parts[#parts + 1] = string.sub(v, off, off + 4)
      else
        dropped = dropped + 1
      end
    end
    local nv = table.concat(parts)
    if nv == '' then
      redis.call('DEL', KEYS[k])
    elseif nv ~= v then
      redis.call('SET', KEYS[k], nv)
    end
  end
end
return dropped
"""

# KEYS: lease keys. ARGV: token, ttl ms.
_ACQUIRE_LUA = _LUA_NOW + """
local ttl = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, now + ttl, ARGV[1])
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return 1
"""

# KEYS: lease keys. Returns the 0-based indexes of keys holding an unexpired lease.
_LEASED_LUA = _LUA_NOW + """
local out = {}
for k, key in ipairs(KEYS) do
  if redis.call('ZCOUNT', key, '(' .. now, '+inf') > 0 then out[#out + 1] = k - 1 end
end
return out
"""


def check_hashes(hashes: Iterable[bytes]) -> list[bytes]:
    """`hashes` as a list; raises `BadBlockHashError` on anything but 16-byte `bytes`."""
    out = list(hashes)
    if out and (set(map(type, out)) != {bytes} or set(map(len, out)) != {BLOCK_HASH_BYTES}):
        bad = next(h for h in out if type(h) is not bytes or len(h) != BLOCK_HASH_BYTES)
        raise BadBlockHashError(f"block hash must be {BLOCK_HASH_BYTES} bytes, got {bad!r}")
    return out


def _resp_bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class _PackedScript:
    """A Lua script run as a hand-packed EVALSHA on connections of its own.

    For the lookup's ~70 arguments redis-py's generic command packer and its pool bookkeeping
    cost more client CPU than the server spends running the script; packing the fixed parts
    once, the block keys with one `bytes.join`, and keeping a few idle connections here (a
    list: `pop`/`append` are atomic, so concurrent lookups each get their own) makes the lookup
    fast enough for the 5,000/s target.
    """

    def __init__(self, source: str, client: redis.Redis) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest().encode()
        self._client = client
        self._idle: list[redis.connection.AbstractConnection] = []

    def head(self, *, num_args: int, num_keys: int) -> bytes:
        """RESP of `*<n> EVALSHA <sha> <numkeys>`: `num_args` counts the arguments after it."""
        keys = str(num_keys).encode()
        return b"*%d\r\n$7\r\nEVALSHA\r\n%s%s" % (num_args + 3, _resp_bulk(self.sha),
                                                     _resp_bulk(keys))

    def run(self, packed: bytes) -> object:
        """Send `packed` and return the reply; loads the script once if the server lacks it."""
        conn = self._take()
        try:
            reply = self._send(conn, packed)
        except BaseException:
            conn.disconnect()
            raise
        self._idle.append(conn)
        return reply

    def _send(self, conn: redis.connection.AbstractConnection, packed: bytes) -> object:
        conn.send_packed_command([packed], check_health=False)
        try:
            return conn.read_response()
        except NoScriptError:  # a restarted server: load the script, then once more
            self._client.script_load(self.source)
        conn.send_packed_command([packed], check_health=False)
        return conn.read_response()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().disconnect()

    def _take(self) -> redis.connection.AbstractConnection:
        try:
            conn = self._idle.pop()
        except IndexError:
            pool = self._client.connection_pool
            return pool.connection_class(**pool.connection_kwargs)
        if conn.can_read():  # the server closed it (restart) or left data: start afresh
            conn.disconnect()
        return conn


def _chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    return (items[i:i + size] for i in range(0, len(items), size))


class ClusterIndex:
    """This holder's handle on the cluster-wide block index (thread-safe).

    `lookup` never blocks on the write lock; writes (`reserve`, `publish`, `remove`, `move`)
    and re-synchronisation are serialised by one lock so a re-publish can't resurrect a block
    removed concurrently.
    """

    def __init__(self, url: str, holder: HolderId, *, heartbeat_ttl_s: float = 10.0,
                 namespace: str = "hm", reservation_ttl_s: float = 30.0,
                 max_lease_ttl_s: float = 30.0, retry_interval_s: float = 1.0,
                 socket_timeout_s: float = 2.0, gc_keys_per_step: int = 1000) -> None:
        if not _NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {_NAMESPACE_RE.pattern}")
        for name, value in (("heartbeat_ttl_s", heartbeat_ttl_s),
                            ("reservation_ttl_s", reservation_ttl_s),
                            ("max_lease_ttl_s", max_lease_ttl_s)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.url = url
        self.holder = holder
        self.namespace = namespace
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.reservation_ttl_s = reservation_ttl_s
        self.max_lease_ttl_s = max_lease_ttl_s
        self.retry_interval_s = retry_interval_s
        self.gc_keys_per_step = gc_keys_per_step
        self.stats = IndexStats()
        self.healthy = True
        self._init_keys(namespace)
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
        self._lookup_fixed_keys = b"".join(_resp_bulk(k.encode())
                                           for k in (self._epoch_key, self._live_key,
                                                     self._names_key))
        self._block_arg_head = b"$%d\r\n%s" % (len(self._block_prefix) + BLOCK_HASH_BYTES,
                                                self._block_prefix)
        self._block_arg_sep = b"\r\n" + self._block_arg_head

    def _init_client(self, url: str, socket_timeout_s: float) -> None:
        # No client-side retries: an outage must surface at once so the verb can degrade; the
        # next call reconnects by itself.
        self._redis = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=min(socket_timeout_s, 1.0),
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        script = self._redis.register_script
        self._lookup_call = _PackedScript(_LOOKUP_LUA, self._redis)
        self._apply_script = script(_APPLY_LUA)
        self._reserve_script = script(_RESERVE_LUA)
        self._register_script = script(_REGISTER_LUA)
        self._heartbeat_script = script(_HEARTBEAT_LUA)
        self._live_script = script(_LIVE_LUA)
        self._sweep_script = script(_SWEEP_LUA)
        self._acquire_script = script(_ACQUIRE_LUA)
        self._leased_script = script(_LEASED_LUA)

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
        self._thread: threading.Thread | None = None
        self._closed = False

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
                         self._block_arg_sep.join(blocks), b"\r\n", _resp_bulk(self._epoch),
                         _resp_bulk(self._num_arg.encode())))

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
            newly = self._reserve_chunks(blocks, tier)
            if newly is not None:
                return newly
            self._stale = True
            if not self._ready("reserve"):
                break
        return self._reserve_local(blocks, tier)

    def _reserve_chunks(self, blocks: list[bytes], tier: Tier) -> list[bytes] | None:
        """Newly reserved blocks, or None when this holder's registration is gone."""
        newly: list[bytes] = []
        ttl_ms = int(self.reservation_ttl_s * 1000)
        args = [self._epoch, self._packed_num, int(tier), ttl_ms, len(self._block_prefix)]
        for chunk in _chunks(blocks, WRITE_CHUNK):
            keys = [self._epoch_key, self._reservations_key(),
                    *[self._block_prefix + h for h in chunk]]
            ok, *indexes = self._reserve_script(keys=keys, args=args)
            if not ok:
                return None
            newly += [chunk[i] for i in indexes]
        return newly

    def _reserve_local(self, blocks: list[bytes], tier: Tier) -> list[bytes]:
        now, held, newly = time.monotonic(), self._held[tier], []
        seen: set[bytes] = set()
        for h in blocks:
            if h not in held and h not in seen and self._reserving.get((tier, h), 0.0) <= now:
                newly.append(h)
            seen.add(h)
        return newly

    def _remember_reservations(self, newly: list[bytes], tier: Tier) -> None:
        now = time.monotonic()
        if len(self._reserving) > _RESERVATION_PURGE_AT:
            self._reserving = {k: t for k, t in self._reserving.items() if t > now}
        deadline = now + self.reservation_ttl_s
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

    def _apply(self, blocks: Sequence[bytes], set_mask: int, clear_mask: int) -> bool:
        """Apply the tier bits to every block, chunked; False if this num is not live."""
        prefix = self._block_prefix
        args = [self._epoch, self._num_arg, self._packed_num, set_mask, clear_mask, len(prefix)]
        for chunk in _chunks(blocks, WRITE_CHUNK):
            keys = [self._epoch_key, self._live_key, self._reservations_key(),
                    *[prefix + h for h in chunk]]
            if not self._apply_script(keys=keys, args=args):
                return False
        return True

    def _reservations_key(self) -> str:
        return f"{self.namespace}:r:{self._num_arg}"

    # ---------------------------------------------------------------- leases

    def acquire_lease(self, holder: HolderId, hashes: Sequence[bytes],
                      ttl_s: float) -> LeaseId:
        """Lease `hashes` at `holder` for reading: its evictor keeps them until the lease is
        released or `ttl_s` passes. Raises `IndexUnavailableError` when Redis is unreachable
        (the reader must not read remotely then) and `ValueError` for a bad `ttl_s`.
        """
        blocks = check_hashes(hashes)
        if not 0 < ttl_s <= self.max_lease_ttl_s:
            raise ValueError(f"lease ttl_s must be in (0, {self.max_lease_ttl_s}], got {ttl_s}")
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
        if time.monotonic() < self._lease_blackout_until:
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
            args = [self._epoch, self._num_arg, int(self.heartbeat_ttl_s * 1000)]
            if self._heartbeat_script(keys=keys, args=args):
                return True
            self._stale = True
            return self._ready("heartbeat")
        return self._call("heartbeat", remote, lambda: False)

    def start(self) -> ClusterIndex:
        """Start the background thread: heartbeat every `heartbeat_ttl_s / 3`, plus a GC step."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                            name=f"cluster-index-heartbeat[{self.holder.key}]")
            self._thread.start()
        return self

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_ttl_s / 3):
            try:
                if self.heartbeat():
                    self.gc_step()
            except (RedisError, ClusterIndexError):
                # Outages are handled inside the verbs; this is a bug or a Redis refusal (OOM,
                # ACL): say so on every beat rather than let the thread die and the holder expire.
                logger.exception("cluster index: heartbeat of %s failed", self.holder.key)

    def stop_heartbeat(self) -> None:
        """Stop the background thread (the holder then expires after `heartbeat_ttl_s`)."""
        self._stop.set()
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
        if self.healthy and self._num is not None:
            try:
                self._deregister()
            except _OUTAGE_ERRORS as err:
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

    def __enter__(self) -> ClusterIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def gc_step(self) -> int:
        """Sweep the next `gc_keys_per_step` block keys for dead holders' entries; returns how
        many were dropped. Idle unless some holder died; a full SCAN cycle retires the dead
        holders it started with."""
        if self.gc_keys_per_step <= 0:
            return 0
        return self._call("gc", self._gc_remote, lambda: 0)

    def _gc_remote(self) -> int:
        if self._gc_cursor == 0:
            self._gc_dead = self._redis.zrange(self._dead_key, 0, -1)
            if not self._gc_dead:
                return 0
        cursor, keys = self._redis.scan(self._gc_cursor, match=self._block_prefix + b"*",
                                        count=self.gc_keys_per_step)
        dropped = int(self._sweep_script(keys=[self._live_key, *keys])) if keys else 0
        self._gc_cursor = int(cursor)
        if self._gc_cursor == 0:
            self._redis.zrem(self._dead_key, *self._gc_dead)
        self.stats.gc_pruned += dropped
        return dropped

    # ---------------------------------------------------------------- fault handling

    def _call(self, verb: str, remote: Callable[[], T], degraded: Callable[[], T]) -> T:
        """`remote()` against Redis, or `degraded()` when Redis is (or just went) unreachable."""
        if not self._ready(verb):
            self.stats.degraded_calls += 1
            return degraded()
        try:
            return remote()
        except _OUTAGE_ERRORS as err:
            self._on_outage(verb, err)
            return degraded()

    def _ready(self, verb: str) -> bool:
        """True when Redis can be used now; re-syncs first if the index may lack our blocks."""
        if self._closed:
            raise IndexClosedError(f"{verb} on a closed ClusterIndex ({self.holder.key})")
        if self.healthy and not self._stale:
            return True
        if not self.healthy and time.monotonic() < self._next_probe:
            return False
        return self._resync(verb)

    def _resync(self, verb: str) -> bool:
        """Register a fresh incarnation and re-publish every block held (under the lock)."""
        with self._lock:
            if self.healthy and not self._stale:
                return True  # another thread just did it
            try:
                republished = self._register_and_republish()
            except _OUTAGE_ERRORS as err:
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
            f"{self.heartbeat_ttl_s} is too short for that")

    def _register(self) -> None:
        ttl_ms = int(self.heartbeat_ttl_s * 1000)
        epoch, num = self._register_script(
            keys=[self._epoch_key, self._seq_key, self._names_key, self._live_key,
                  self._dead_key],
            args=[secrets.token_hex(8), self.holder.key, self._epoch, self._num_arg, ttl_ms])
        if self._epoch and epoch != self._epoch:
            # Redis lost its data (restart, flush): lease records taken before are gone too.
            self._lease_blackout_until = max(self._lease_blackout_until,
                                             time.monotonic() + self.max_lease_ttl_s)
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
            self._next_probe = time.monotonic() + self.retry_interval_s
            if not self.healthy:
                return
            self.healthy = False
            self._stale = True
            self._lease_blackout_until = time.monotonic() + self.max_lease_ttl_s
        logger.warning("cluster index: Redis at %s is unreachable (%s failed: %s: %s); holder "
                       "%s degrades to local-only lookups and re-publishes its blocks when Redis "
                       "is back", self.url, verb, type(err).__name__, err, self.holder.key)
