"""Mooncake-format request traces: a line reader and a token synthesizer.

One JSON object per line (blank lines are skipped, extra keys ignored):

    {"timestamp": 150, "input_length": 1123, "output_length": 145, "hash_ids": [0, 1, 6]}

`timestamp` is in ms; `hash_ids` names the prompt's 512-token blocks, so there are exactly
ceil(input_length / 512) of them, and two requests whose hash_ids agree on a prefix share that
prefix of tokens. Traces carry no text: `synthesize_tokens` makes token ids from the hash ids so
that equal hash ids give equal 512-token blocks, deterministically on every machine:

    hash_ids     [   7   |   8   |  21 ]
    tokens       | 512 t | 512 t | 99 t |    the last block truncated to input_length

The line reader (`read_trace`, `TraceError` naming file and line) is the simulator's,
`sim/trace.py`, re-exported here.
"""

from __future__ import annotations

import numpy as np

from halfmoon.sim.trace import HASH_BLOCK_TOKENS, REQUIRED_KEYS, TraceError, TraceRequest, parse_line, read_trace

__all__ = ["DEFAULT_VOCAB_SIZE", "HASH_BLOCK_TOKENS", "REQUIRED_KEYS", "TraceError", "TraceRequest",
           "block_tokens", "parse_line", "read_trace", "synthesize_tokens"]

DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's vocabulary

_MASK64 = (1 << 64) - 1
# splitmix64 constants (Steele et al.): a counter-based generator, so a block's tokens depend
# only on its hash id and position, never on the order blocks are synthesized in.
_GAMMA, _MIX1, _MIX2 = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9),
                        np.uint64(0x94D049BB133111EB))


def block_tokens(hash_id: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> np.ndarray:
    """The 512 token ids (uint32, in [0, vocab_size)) of the block named `hash_id`.

    Each hash id seeds its own block: token j is splitmix64(hash_id * 512 + j) mod vocab_size.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    base = np.uint64((hash_id * HASH_BLOCK_TOKENS) & _MASK64)
    z = np.arange(HASH_BLOCK_TOKENS, dtype=np.uint64) + base + _GAMMA  # wraps mod 2^64
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return (z % np.uint64(vocab_size)).astype(np.uint32)


def synthesize_tokens(request: TraceRequest, vocab_size: int = DEFAULT_VOCAB_SIZE,
                      scale_tokens: int = HASH_BLOCK_TOKENS) -> np.ndarray:
    """The request's prompt: its hash ids' blocks concatenated, truncated to input_length.

    `scale_tokens` < 512 shrinks the trace: each hash id's block is its first `scale_tokens`
    tokens and the prompt ceil(input_length * scale_tokens / 512) long, so requests share exactly
    the prefixes they share in the trace at a fraction of the compute (a long trace on a CPU).
    """
    if not 0 < scale_tokens <= HASH_BLOCK_TOKENS:
        raise ValueError(f"scale_tokens must be in 1..{HASH_BLOCK_TOKENS}, got {scale_tokens}")
    blocks = [block_tokens(h, vocab_size)[:scale_tokens] for h in request.hash_ids]
    tokens = np.concatenate(blocks) if blocks else np.empty(0, dtype=np.uint32)
    return tokens[: -(-request.input_length * scale_tokens // HASH_BLOCK_TOKENS)]
