"""Where Halfmoon keeps what it measured or computed once per machine (profiles, dequantized
weights): `$HALFMOON_CACHE_DIR`, default `~/.cache/halfmoon`."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HALFMOON_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "halfmoon")
