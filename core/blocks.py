"""Block arithmetic: the one place ceil-division is written."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceil of a / b for a >= 0, b > 0 (e.g. KV blocks needed for `a` tokens of block size `b`)."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """`a` rounded up to a multiple of `multiple`."""
    return cdiv(a, multiple) * multiple
