"""KV transfer between workers: backends (ucxx, tcp, local), handshake, checksummed transfer
units written straight into the peer's paged KV tensor, and layer-pipelined pushes.

The names below are imported on first use, so `import transport.config` (what a command line
needs to build its flags) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"BACKENDS": "halfmoon.transport.channel", "get_backend": "halfmoon.transport.channel", "KVLayout": "halfmoon.transport.layout",
          "KVReceiver": "halfmoon.transport.receiver", "TransferResult": "halfmoon.transport.receiver",
          "KVSender": "halfmoon.transport.sender", "PushStream": "halfmoon.transport.sender"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
