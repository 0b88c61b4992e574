"""Logits masked by a grammar's token bitmask, in place: -inf wherever a row's bit is 0.

    mask_logits(logits [R, V] fp32, bitmask [R', ceil(V / 32)] int32, rows, bit_rows)
        logits[rows[i]] masked by bitmask[bit_rows[i]]

On the CPU one native call per row (kernels/_fused.c `mask_by_bits`: all-ones words skipped,
all-zero words written whole, ~0.1-0.3 ms for 32 rows of a 49k vocabulary); on another device,
or without the extension, torch ops that unpack every bit (~10 ms for 32 rows on this CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

try:
    from halfmoon.kernels import _fused
except ImportError:  # kernels/fused.py warns about the missing extension once
    _fused = None
if _fused is not None and not hasattr(_fused, "mask_by_bits"):  # built before it had the call
    logging.getLogger(__name__).warning(
        "halfmoon.kernels._fused predates mask_by_bits: constrained decoding masks with torch ops "
        "(~10 ms a 32-row step); rebuild with `python setup.py build_ext --inplace`")
    _fused = None

_BITS = torch.arange(32, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], bit_rows: Sequence[int]) -> None:
    if _native(logits, bitmask):
        n, stride, words = logits.shape[1], logits.stride(0), bitmask.shape[1]
        base, bits = logits.data_ptr(), bitmask.data_ptr()
        for r, b in zip(rows, bit_rows):
            _fused.mask_by_bits(base + 4 * r * stride, stride, bits + 4 * b * words, words, 1, n)
        return
    _mask_torch(logits, bitmask, rows, bit_rows)


def _native(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    return (_fused is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.stride(1) == 1 and bitmask.dtype == torch.int32 and bitmask.is_contiguous())


def _mask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int], bit_rows: Sequence[int]) -> None:
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    words = bitmask[list(bit_rows)].to(logits.device)
    allowed = (words.unsqueeze(-1) >> _BITS.to(logits.device)).bitwise_and_(1).view(len(rows), -1)
    allowed = allowed[:, : logits.shape[1]].bool()
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
