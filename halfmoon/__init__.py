"""halfmoon.

`halfmoon.Client`, `halfmoon.AsyncClient` and `halfmoon.APIError` are the SDK of
`halfmoon.client`, imported on first use so `import halfmoon` stays cheap (no grpc).
"""

from __future__ import annotations

from typing import Any

_CLIENT_NAMES = frozenset({"Client", "AsyncClient", "APIError"})


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from halfmoon import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_CLIENT_NAMES})
