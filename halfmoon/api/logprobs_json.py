"""Logprobs in OpenAI's two shapes, from the engine's `TokenLogprobs` (one per generated token:
the sampled token's logprob and the top alternatives, log_softmax of the raw logits).

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`.
A token's string is its bytes as UTF-8; a token that is part of a character (byte-level
vocabularies split multi-byte characters) is spelled `bytes:\\xNN...`, as vLLM does, and its
`bytes` field (chat) carries the raw bytes either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from halfmoon.core.messages import TokenLogprobs
from halfmoon.engine.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """(the token's string, its bytes)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def _chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        entry = _chat_entry(tokenizer, token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_entry(tokenizer, i, v) for i, v in lp.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                        offset: int = 0) -> dict[str, Any]:
    """`offset`: where the first token's text starts in the choice's text (a stream's chunks
    continue from the text before them)."""
    tokens, offsets = [], []
    for token_id in token_ids:
        text, _ = token_text(tokenizer, token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
    tops = [{token_text(tokenizer, i)[0]: v for i, v in lp.top} for lp in logprobs]
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(tokenizer: Tokenizer, prompt_ids: Sequence[int], prompt: Sequence[TokenLogprobs],
                  token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """Completions' logprobs with `echo`: the prompt's tokens first (the first has none: null),
    then the generated ones."""
    out = completion_logprobs(tokenizer, [*prompt_ids, *token_ids], [*prompt, *logprobs])
    out["token_logprobs"].insert(0, None)
    out["top_logprobs"].insert(0, None)
    return out


def logprobs_json(tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None,
                  chat: bool, offset: int = 0) -> dict[str, Any] | None:
    """The choice's `logprobs` field: None when the request did not ask for them."""
    if logprobs is None:
        return None
    if chat:
        return chat_logprobs(tokenizer, token_ids, logprobs)
    return completion_logprobs(tokenizer, token_ids, logprobs, offset)
