"""The prefill side's connections, one per decode worker: cached, and re-established when one
broke (the receiver restarted, a network blip). Pushes that were in flight on a broken
connection have already failed with its error; only new streams use the new connection.

    peers = KVPeers(kv_cache, layout, TransportConfig(backend="ucxx"))
    stream = peers.sender(decode_address).open(request_id, dst_blocks)
"""

from __future__ import annotations

import logging
import threading

import torch

from halfmoon.transport.channel import Backend
from halfmoon.transport.config import TransportConfig
from halfmoon.transport.faults import FaultInjector
from halfmoon.transport.layout import KVLayout
from halfmoon.transport.sender import KVSender

log = logging.getLogger("halfmoon.transport")


class KVPeers:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, config: TransportConfig,
                 backend: Backend | None = None, faults: FaultInjector | None = None) -> None:
        """`backend` defaults to `config.make_backend()` (which fails loudly if unavailable)."""
        self.kv_cache = kv_cache
        self.layout = layout
        self.config = config
        self.backend = backend if backend is not None else config.make_backend()
        self.faults = faults
        self._secret = config.secret()
        self._senders: dict[str, KVSender] = {}
        self._lock = threading.Lock()
        self.reconnects = 0

    def sender(self, address: str) -> KVSender:
        """A connected sender to `address`: the cached one, or a new connection (handshake
        included) if there is none or the cached one broke."""
        with self._lock:
            cached = self._senders.get(address)
            if cached is not None and cached.broken is None:
                return cached
            if cached is not None:
                log.info("KV connection to %s broke (%s); reconnecting", address, cached.broken)
                cached.close()
                self.reconnects += 1
            sender = KVSender(self.kv_cache, self.layout, self.backend, address, secret=self._secret,
                              timeout=self.config.timeout_s,
                              max_inflight_bytes=self.config.max_inflight_bytes, faults=self.faults)
            self._senders[address] = sender
            return sender

    def close(self) -> int:
        """Close every connection (the next `sender` opens a new one); how many were open. A
        push in flight on one of them fails (the drills' dropped connection)."""
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.close()
        return len(senders)
