"""The prefill side of disaggregation: while a step's forward pass runs, push each layer's new KV
of the requests that carry a push stream to their decode worker (DistServe / Mooncake
layer-wise transfer), so the send of layer l overlaps the compute of layers l+1..L.

A step that computes tokens [start, end) of such a request sends, right after layer l, layer l
of blocks [pushed, last), where last = end // block_size (full blocks only) — or
ceil(end / block_size) on the step that completes the prompt:

    | pushed by earlier steps | full blocks of this step | partial block (only with the last chunk) |

So every block is sent exactly once, after its KV is final: no later step writes it, and the
sender thread may read it from the KV tensor while the model computes the next layers. The
blocks stay referenced until their units have left (`Engine` holds them past the request's end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.scheduler import ScheduledRequest
from transport.errors import TransportError
from transport.sender import PushStream


@dataclass(slots=True, eq=False)
class KVPush:
    stream: PushStream
    pushed: int = 0  # blocks [0, pushed) of the block table are queued for every layer
    error: TransportError | None = None  # the first send that failed; the request is aborted


class LayerPusher:
    """The model's per-layer hook for one step: `plan()` before the forward, then the model calls
    it with each layer index."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._items: list[tuple[KVPush, list[int], list[int]]] = []

    def plan(self, scheduled: Sequence[ScheduledRequest], pushes: dict[str, KVPush]) -> bool:
        """Pick this step's (source, destination) block ranges; False when nothing is pushed."""
        self._items = []
        if not pushes:
            return False
        for s in scheduled:
            push = pushes.get(s.request.request_id)
            if push is None or push.error is not None:
                continue
            req = s.request
            end = req.num_computed_tokens + s.num_tokens
            last = -(-end // self.block_size) if end >= req.num_prompt_tokens else end // self.block_size
            if last > push.pushed:
                src = req.block_table[push.pushed : last]
                dst = push.stream.dst_block_ids[push.pushed : last]
                self._items.append((push, src, dst))
                push.pushed = last
        return bool(self._items)

    def __call__(self, layer: int) -> None:
        for push, src, dst in self._items:
            if push.error is not None:
                continue
            try:
                push.stream.send_layer(layer, src, dst)
            except TransportError as e:  # fail this request, not the whole step
                push.error = e
