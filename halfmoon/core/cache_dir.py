"""Where Halfmoon keeps what it measured or computed once per machine (profiles, dequantized
weights): `$HALFMOON_CACHE_DIR`, default `~/.cache/halfmoon`."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_ENV = "HALFMOON_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "halfmoon")


def cache_key(shape: dict[str, object]) -> str:
    """A cache entry's name: what its content depends on, as canonical JSON, sha256, 24 hex."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:24]
