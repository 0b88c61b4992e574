"""Block identity: chained sha256 hashes of full token blocks (docs/ARCHITECTURE.md, "Block identity").

    h_0 = H("halfmoon-kv/1", model fingerprint, dtype, block_size, cache_salt[, LoRA adapter digest])
    h_i = H(h_{i-1}, token_ids of block i)

H is sha256 over a canonical byte encoding (length-prefixed UTF-8 strings, little-endian u32
integers), truncated to 16 bytes. Only full blocks are hashed. Never Python's `hash()`: the same
tokens give the same hash on every process and node, today and after an upgrade (golden tests
pin the values). A different `cache_salt` gives a different root, hence disjoint hashes: tenants
never hit each other's blocks; a LoRA adapter's digest (when the request has one) roots its own
chain, so a prefix computed under one adapter is no hit for another or for the base model.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from halfmoon.kvpool.errors import BadBlockHashError

HASH_BYTES = 16  # the one place a block hash's size is written
_DOMAIN = b"halfmoon-kv/1"


def _field(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def root_hash(model_fingerprint: str, dtype: str, block_size: int, cache_salt: str | None = None,
              adapter: str = "") -> bytes:
    """h_0 for one model/dtype/block size/tenant/LoRA adapter; `None` and "" salts are the same
    tenant; `adapter` (AdapterRef.cache_key, "" = the base model) is hashed only when given, so
    the base model's roots are those of before adapters existed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    payload = _DOMAIN + _field(model_fingerprint) + _field(dtype) + struct.pack("<I", block_size)
    payload += _field(cache_salt or "")
    if adapter:
        payload += _field(adapter)
    return hashlib.sha256(payload).digest()[:HASH_BYTES]


def chain_hash(parent: bytes, block_tokens: Sequence[int]) -> bytes:
    """h_i from h_{i-1} and block i's token ids."""
    tokens = np.asarray(block_tokens, dtype="<u4").tobytes()
    return hashlib.sha256(parent + struct.pack("<I", len(block_tokens)) + tokens).digest()[:HASH_BYTES]


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes,
                 known: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of every full block of `token_ids`, reusing `known` (a prefix computed earlier)."""
    hashes = list(known)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def check_hashes(hashes: Iterable[bytes]) -> list[bytes]:
    """`hashes` as a list of `bytes` (bytearray / memoryview copied), each `HASH_BYTES` long.

    Raises `BadBlockHashError` (a ValueError) on anything else and TypeError for one bytes
    object (a hash where a sequence of them was meant). The common case, a list of valid
    `bytes`, is checked without a Python loop: every index verb runs this.
    """
    if isinstance(hashes, (bytes, bytearray, memoryview)):
        raise TypeError(f"hashes must be a sequence of {HASH_BYTES}-byte hashes, not one bytes "
                        f"object")
    out = list(hashes)
    if out and (set(map(type, out)) != {bytes} or set(map(len, out)) != {HASH_BYTES}):
        out = [bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h for h in out]
        bad = next((h for h in out if type(h) is not bytes or len(h) != HASH_BYTES), None)
        if bad is not None:
            raise BadBlockHashError(f"a block hash is {HASH_BYTES} bytes, got {bad!r}")
    return out
