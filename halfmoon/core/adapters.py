"""LoRA adapters at the process seams: what a request names, and the base model's shapes an
adapter is checked against (engine/lora.py reads and serves them).

An `AdapterRef` travels in `SamplingParams.adapter` from the front door to the prefill and decode
workers (and through migration and `n` choices with the rest of the parameters): its `path` is
where any worker reads the adapter from (a folder every node mounts, e.g. a PVC), its `digest`
identifies the weights (sha256 of the adapter's two files) and roots the request's KV block
hashes, so a prefix computed under one adapter is never a hit for another, for the base model,
or for new weights loaded under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.core.errors import HalfmoonError, StructuredError

# PEFT's module names of the projections Halfmoon serves LoRA on, in the order the engine stacks
# them into its fused projections (q/k/v -> qkv, gate/up -> gate_up).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One loaded adapter as a request carries it: served `name`, `path` and weights `digest`."""

    name: str
    path: str
    digest: str

    @property
    def cache_key(self) -> str:
        """What roots its KV hashes (kvpool/block_hash.py root_hash's `adapter`)."""
        return f"lora:{self.digest}"


@dataclass(frozen=True, slots=True)
class LoraShapes:
    """The base model's shapes a LoRA adapter must fit: (in, out) features of each target module,
    the layer count, and the names it may say it was trained on (`base_names`)."""

    num_layers: int
    modules: tuple[tuple[str, int, int], ...]  # (module, in_features, out_features)
    base_names: tuple[str, ...] = ()

    def features(self, module: str) -> tuple[int, int]:
        for name, fan_in, fan_out in self.modules:
            if name == module:
                return fan_in, fan_out
        raise KeyError(module)


class InvalidAdapterError(StructuredError, HalfmoonError, ValueError):
    """An adapter that cannot be served on this base model, with the one reason (HTTP 400)."""

    adapter: str
    reason: str
    fields = ("adapter", "reason")
    template = "adapter {adapter}: {reason}"

