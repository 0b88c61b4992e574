"""Block arithmetic: the one place ceil-division is written."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceil of a / b for a >= 0, b > 0 (e.g. KV blocks needed for `a` tokens of block size `b`)."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """`a` rounded up to a multiple of `multiple`."""
    return cdiv(a, multiple) * multiple


def first_visible_block(prompt_len: int, window: int, block_size: int) -> int:
    """The first block a sliding-window layer still reads once a prompt of `prompt_len` tokens is
    prefilled: the token decoded next (position `prompt_len`) sees keys (prompt_len - window,
    prompt_len], and later tokens see later ones. 0 for a full-attention layer (window 0).
    Blocks before it are dead for that layer: the prefill side does not send them
    (engine/kv_push.py) and the decode side does not cache such a request's prompt blocks."""
    if window <= 0:
        return 0
    return max(0, prompt_len - window + 1) // block_size
