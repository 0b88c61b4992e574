"""JSON a browser can parse: Python's inf / nan (an objective of none) become null."""

from __future__ import annotations

import math
from typing import Any


def finite(value: Any) -> Any:
    """JSON for a browser: inf / nan (an objective of none) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
