"""Gemma 3's SentencePiece tokenizer built from its GGUF (262,144 pieces, byte fallback, no merges
in the file): encode token-identical to transformers' tokenizer loaded from the same GGUF, decode
and streaming decode round-trip, the family's chat template, <end_of_turn> stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from halfmoon.engine.gguf_header import read_header
from halfmoon.engine.loader import resolve_model_path
from halfmoon.engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = [pytest.mark.timeout(300)]

TEXTS = [
    "Hello world",
    "  two  spaces   three    four",
    "   leading and trailing   ",
    "line one\nline two\n\n\nafter three newlines\r\nwindows",
    "\ttab\t\tand\n\t nested",
    "héllo wörld Ångström café naïve",
    "日本語のテキスト、中文文本，한국어",
    "Ελληνικά русский العربية हिन्दी",
    "emoji 😀 🇫🇷 👨‍👩‍👧‍👦 family",
    "1234567890 3.14159 1,000,000 2024-01-31",
    "def f(x):\n    return x ** 2  # square",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "[multimodal] a user-defined token",
    "I'm, you're, they've; it's.",
    "URL: https://example.com/a?b=c&d=e#f",
    "∑ ∫ √ ∞ ≠ ≤ \u00a0nbsp \u200bzero-width",
    "control \x00\x01\x7f bytes",
    "",
    " ",
    "a",
]


@pytest.fixture(scope="module")
def path() -> Path:
    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def tok(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_reader(read_header(path))


@pytest.fixture(scope="module")
def oracle(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, oracle: Any, text: str) -> None:
    assert tok.encode(text) == oracle.encode(text)  # BOS included: the file's add_bos_token


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_and_round_trips(tok: Tokenizer, oracle: Any, text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids, skip_special=False) == text
    for skip in (True, False):
        assert tok.decode(ids, skip_special=skip) == oracle.decode(ids, skip_special_tokens=skip)
    stream = IncrementalDetokenizer(tok, skip_special=False)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text


def test_special_ids_and_turn_end(tok: Tokenizer) -> None:
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (262144, 2, 1, True)
    end_of_turn = tok.encode("<end_of_turn>", add_bos=False)
    assert end_of_turn == [106] and tok.stop_ids == frozenset({1, 106})
    assert tok.is_special(106) and not tok.is_special(tok.encode("\n", add_bos=False)[0])
    assert tok.token_bytes(tok.encode("é", add_bos=False)[0]) == "é".encode()
    assert tok.token_bytes(tok.encode(" x", add_bos=False)[0]).startswith(b" ")


def test_the_family_chat_template_and_a_single_bos(tok: Tokenizer) -> None:
    """The GGUF has no template: Gemma 3's (it writes <bos> itself; encode adds no second one)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!"
                    "<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(text)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1
