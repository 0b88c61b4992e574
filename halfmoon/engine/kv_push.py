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

A sliding-window layer (Mistral, Gemma 3's local layers) skips the blocks no later query of the
request can see (`core.blocks.first_visible_block`): for a prompt of P tokens and a window W,
only blocks from (P - W + 1) // block_size on are sent for that layer. The decode side then holds
stale data there for that layer, never read, and does not cache that request's prompt blocks
(engine.Engine.add_prefilled).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from halfmoon.core.blocks import cdiv, first_visible_block
from halfmoon.core.messages import ChoiceStart, PrefilledKV
from halfmoon.core.params import FinishReason
from halfmoon.engine.request import Request
from halfmoon.engine.scheduler import ScheduledRequest
from halfmoon.kvpool.block_pool import BlockPool
from halfmoon.transport.errors import TransportError
from halfmoon.transport.sender import PushStream as OnePushStream
from halfmoon.transport.tp import RankPushStream

# one connection's stream, or a worker's (one per prefill rank x decode rank pair): the same verbs
PushStream = OnePushStream | RankPushStream


@dataclass(slots=True, eq=False)
class KVPush:
    stream: PushStream
    pushed: int = 0  # blocks [0, pushed) of the block table are queued for every layer
    error: TransportError | None = None  # the first send that failed; the request is aborted


class LayerPusher:
    """The model's per-layer hook for one step: `plan()` before the forward, then the model calls
    it with each layer index."""

    def __init__(self, block_size: int, windows: Sequence[int] = ()) -> None:
        """`windows`: each layer's sliding window (0 = full attention; () = every layer full)."""
        self.block_size = block_size
        self.windows = tuple(windows)
        # (push, first block index of this step's range, src ids, dst ids, prompt tokens)
        self._items: list[tuple[KVPush, int, list[int], list[int], int]] = []

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
            last = cdiv(end, self.block_size) if end >= req.num_prompt_tokens else end // self.block_size
            if last > push.pushed:
                src = req.block_table[push.pushed : last]
                dst = push.stream.dst_block_ids[push.pushed : last]
                self._items.append((push, push.pushed, src, dst, req.num_prompt_tokens))
                push.pushed = last
        return bool(self._items)

    def __call__(self, layer: int) -> None:
        window = self.windows[layer] if self.windows else 0
        for push, first, src, dst, prompt_len in self._items:
            if push.error is not None:
                continue
            skip = max(0, first_visible_block(prompt_len, window, self.block_size) - first)
            try:
                push.stream.send_layer(layer, src[skip:], dst[skip:])
            except TransportError as e:  # fail this request, not the whole step
                push.error = e


class KVPushes:
    """The engine's prefill-side push state: the requests whose KV is pushed as it is computed,
    and the blocks of ended ones, kept referenced until their units have left.

    Per step the engine calls `flush(preempted)`, `hook(scheduled)` (the model's layer hook),
    and after it `failed_ids()`; when a request ends, `end(req, reason)`; `release_sent()`
    frees what has left (each step, and an idle engine's loop while `holding`)."""

    def __init__(self, pool: BlockPool, block_size: int, windows: Sequence[int] = ()) -> None:
        self.pool = pool
        self.active: dict[str, KVPush] = {}
        self.pusher = LayerPusher(block_size, windows)
        self._held: list[tuple[PushStream, list[int]]] = []

    def add(self, request_id: str, stream: PushStream) -> None:
        self.active[request_id] = KVPush(stream)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.active

    def failed(self, request_id: str) -> bool:
        """Its KV never reached the decode side: the request is aborted."""
        push = self.active.get(request_id)
        return push is not None and push.error is not None

    def failed_ids(self) -> list[str]:
        return [rid for rid, push in self.active.items() if push.error is not None]

    def hook(self, scheduled: Sequence[ScheduledRequest]) -> LayerPusher | None:
        """The layer hook for this step's forward pass; None when nothing is pushed."""
        return self.pusher if self.pusher.plan(scheduled, self.active) else None

    def flush(self, preempted: list[Request]) -> None:
        """A preempted request's blocks were just freed and may be reallocated this step: let its
        queued units leave before the forward pass overwrites them."""
        for req in preempted:
            push = self.active.get(req.request_id)
            if push is not None and push.error is None:
                try:
                    push.stream.flush()
                except TransportError as e:  # fails this request only (aborted after the step)
                    push.error = e

    def end(self, req: Request, reason: FinishReason) -> None:
        """The request ends: complete (or cancel) its stream, hold its blocks until sent."""
        push = self.active.pop(req.request_id)
        if reason is not FinishReason.ABORT and push.error is None and req.num_output_tokens > 0:
            try:
                push.stream.finish(prefilled_kv(req).to_meta())
            except TransportError as e:  # the peer went away since the last layer: this request only
                push.error = e  # (its worker's stream.wait raises it: the Conductor re-runs the request)
        if reason is FinishReason.ABORT or push.error is not None or req.num_output_tokens == 0:
            push.stream.cancel()
        if req.block_table:
            self.pool.incref(req.block_table)
            self._held.append((push.stream, list(req.block_table)))

    @property
    def holding(self) -> bool:
        """Blocks of ended requests still wait for their units to leave."""
        return bool(self._held)

    def release_sent(self) -> None:
        """Free the blocks of ended requests whose units have all left."""
        if not self._held:
            return
        keep = []
        for stream, blocks in self._held:
            if stream.sent:
                self.pool.free(blocks)
            else:
                keep.append((stream, blocks))
        self._held = keep


def prefilled_kv(req: Request) -> PrefilledKV:
    """What the decode side needs besides the KV (the generator state only when sampling); an
    n > 1 request's other choices sampled their first tokens from the same logits."""
    prompt = tuple(req.prompt_logprobs or ()) if req.params.prompt_logprobs is not None else None
    first = _start(req)
    return PrefilledKV(first.first_token, req.num_cached_tokens, first.generator_state, first.first_logprobs, prompt,
                       tuple(_start(c) for c in req.forks or ()))


def _start(req: Request) -> ChoiceStart:
    state = None if req.params.greedy else bytes(req.generator.get_state().numpy())
    first_logprobs = req.pending_logprobs[0] if req.pending_logprobs else None  # not yet in a chunk
    return ChoiceStart(req.token_ids[req.num_prompt_tokens], state, first_logprobs)
