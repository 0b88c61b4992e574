"""What the engine checks of a request before it queues it: one function per rule, each raising
`InvalidRequestError` naming the field (the engine's `validate`, `add_request`, `add_prefilled`)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from halfmoon.core.blocks import cdiv
from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.params import SamplingParams, check_token_ids


def as_token_ids(ids: Sequence[int]) -> list[int]:
    """A list of Python ints (numpy/torch integers accepted); anything else is a clear error."""
    try:
        return [operator.index(t) for t in ids]
    except TypeError as e:
        raise InvalidRequestError("prompt_ids", f"token ids must be integers ({e})") from e


def check_request(prompt_ids: list[int], params: SamplingParams, vocab: int, max_model_len: int,
                  capacity_tokens: int) -> None:
    """The prompt's ids, the parameters, and room for prompt + max_tokens in the context and in
    the whole KV cache (`capacity_tokens`)."""
    if len(prompt_ids) == 0:
        raise InvalidRequestError("prompt", "is empty")
    check_token_ids("prompt_ids", prompt_ids, vocab)
    params.validate(vocab)
    n = len(prompt_ids)
    if n >= max_model_len:
        raise InvalidRequestError("prompt", f"{n} tokens; the context holds {max_model_len} (prompt + output), "
                                            f"so at most {max_model_len - 1} prompt tokens")
    if n + params.max_tokens > max_model_len:
        raise InvalidRequestError("max_tokens", f"{params.max_tokens} + {n} prompt tokens exceeds the context of "
                                                f"{max_model_len}; at most {max_model_len - n}")
    if n + params.max_tokens > capacity_tokens:
        raise InvalidRequestError("max_tokens", f"prompt + max_tokens = {n + params.max_tokens} tokens exceeds the "
                                                f"whole KV cache ({capacity_tokens} tokens); raise --kv-cache-gb")


def check_prefilled_blocks(num_prompt_tokens: int, max_tokens: int, num_blocks: int, block_size: int) -> None:
    """A prefilled request's block table covers its prompt and at most its whole output."""
    least = cdiv(num_prompt_tokens, block_size)
    most = cdiv(num_prompt_tokens + max_tokens, block_size)
    if not least <= num_blocks <= most:
        raise InvalidRequestError("block_ids", f"{num_blocks} blocks for a prompt of {num_prompt_tokens} "
                                  f"tokens and {max_tokens} new ones: {least} to {most}")


def check_push(num_prompt_tokens: int, num_dst_blocks: int, block_size: int) -> None:
    """A KV push reserved exactly the prompt's blocks."""
    need = cdiv(num_prompt_tokens, block_size)
    if num_dst_blocks != need:
        raise InvalidRequestError("kv_push", f"the stream reserved {num_dst_blocks} blocks; "
                                  f"a prompt of {num_prompt_tokens} tokens needs {need}")
