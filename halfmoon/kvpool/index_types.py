"""The cluster index's vocabulary: holders, lookup results, leases, counters and errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.kvpool.errors import KVPoolError
from halfmoon.kvpool.tiers import Tier


class ClusterIndexError(KVPoolError):
    """Base of the cluster index's own errors (a bad block hash is kvpool's BadBlockHashError)."""


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
    heartbeats: int = 0  # beats the background thread sent that found this holder live
    max_heartbeat_gap_s: float = 0.0  # longest time between two such beats (vs heartbeat_ttl_s)
