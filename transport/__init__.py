"""KV transfer between workers: backends (ucxx, tcp, local), handshake, checksummed transfer
units written straight into the peer's paged KV tensor, and layer-pipelined pushes."""

from transport.channel import BACKENDS, get_backend
from transport.layout import KVLayout
from transport.receiver import KVReceiver, TransferResult
from transport.sender import KVSender, PushStream

__all__ = ["BACKENDS", "KVLayout", "KVReceiver", "KVSender", "PushStream", "TransferResult", "get_backend"]
