"""Text <-> token ids, the chat template, and streaming detokenization.

The HF `tokenizers` Rust library does the BPE work; this module only builds it from a GGUF's
vocabulary (or loads a `tokenizer.json`) and adds what serving needs on top. Two kinds of
vocabulary, as GGUF's `tokenizer.ggml.model` names them:

    gpt2    byte-level BPE with merges (SmolLM2, Llama 3, Qwen): every byte spelled by a printable
            character (`_BYTE_TO_CHAR`)
    llama   SentencePiece (Gemma 3): pieces with scores, spaces spelled "▁", bytes outside the
            pieces as <0xNN> fallback tokens, no merges (derived from the vocabulary, as
            transformers' GGUF converter derives them: `_spm_merges`)

    Tokenizer.encode / decode            prompt text <-> ids
    Tokenizer.apply_chat_template        messages -> prompt text (sandboxed jinja2, like HF)
    IncrementalDetokenizer.push / flush  one generated id -> newly completed text
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from halfmoon.engine.errors import ChatTemplateError, TokenizerError, UnsupportedModelError, UnsupportedTokenizerError

_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6  # llama.cpp token types
# The control tokens that end a chat turn: generation stops at them as at EOS
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_SPM_SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space
# GGUF architectures whose SentencePiece vocabulary Halfmoon builds (Gemma's conventions)
_SPM_ARCHS = ("gemma3",)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char table: byte-level vocabularies spell every token with it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


_BYTE_TO_CHAR: Mapping[int, str] = MappingProxyType(_bytes_to_unicode())
_CHAR_TO_BYTE: Mapping[str, int] = MappingProxyType({c: b for b, c in _BYTE_TO_CHAR.items()})


def _spelled_bytes(token: str) -> bytes:
    """Raw bytes of a vocabulary token; text outside the byte alphabet is taken as utf-8."""
    if all(c in _CHAR_TO_BYTE for c in token):
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    return token.encode("utf-8")


# The split regexes of llama.cpp's `tokenizer.ggml.pre` types (as transformers' GGUF converter
# and the models' own tokenizer.json have them), applied before the byte-level alphabet
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer the vocabulary's merges were learned with, from `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "gpt2":
        return byte_level
    if pre == "smollm":  # as in SmolLM2's own tokenizer.json
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise UnsupportedTokenizerError(
        f"unsupported GGUF pre-tokenizer type {pre!r} (tokenizer.ggml.pre); "
        f"supported: gpt2, smollm, {', '.join(_SPLITS)}")


def _gguf_fields(reader: Any) -> dict[str, Any]:
    """The `tokenizer.*` metadata as Python values, keyed without `tokenizer.` / `ggml.`."""
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            fields[key.removeprefix("tokenizer.").removeprefix("ggml.")] = field.contents()
    for key in ("model", "tokens", "eos_token_id"):
        if key not in fields:
            raise TokenizerError(f"GGUF has no tokenizer.ggml.{key}; cannot build its tokenizer")
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if fields["model"] == "llama" and arch not in _SPM_ARCHS:
        raise UnsupportedTokenizerError(
            f"GGUF SentencePiece tokenizer ('llama') of architecture {arch!r} is not supported "
            f"(SentencePiece: {', '.join(_SPM_ARCHS)}; byte-level BPE 'gpt2': every architecture)")
    if fields["model"] not in ("gpt2", "llama"):
        raise UnsupportedTokenizerError(
            f"unsupported GGUF tokenizer model {fields['model']!r}; supported: byte-level BPE 'gpt2', "
            "SentencePiece 'llama' (Gemma 3)")
    return fields


def _spm_backend_from_gguf(fields: dict[str, Any]) -> BackendTokenizer:
    """A SentencePiece vocabulary as transformers builds Gemma's from a GGUF (GemmaTokenizer over
    the file's pieces): BPE with byte fallback over the pieces, merges derived from the
    vocabulary, spaces spelled "▁" by the normalizer, control tokens special, user-defined
    ones (newline runs) matched whole. Gemma files spell a piece of 2+ spaces with real spaces:
    respelled "▁▁" so the merges reach it."""
    types: list[int] = fields.get("token_type") or [1] * len(fields["tokens"])
    tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in fields["tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab, _spm_merges(vocab), unk_token=tokens[int(fields.get("unknown_token_id", 3))],
                                          fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(fields["tokens"], types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(fields["tokens"], types) if ty == _USER_DEFINED and t in vocab])
    return backend


def _spm_merges(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Merges a BPE needs to rebuild each piece, best first: for every piece in vocabulary order
    (Gemma's pieces are ordered by merge rank; their scores are not), each split into two pieces
    of the vocabulary, the longest left part first. transformers' `generate_merges` with the
    pieces' positions as scores gives exactly this order."""
    merges = []
    for piece in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _spm_bytes(token: str) -> bytes:
    """Raw bytes of a SentencePiece piece: <0xNN> is byte NN, "▁" a space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace(_SPM_SPACE, " ").encode("utf-8")


def _family_template(reader: Any) -> str | None:
    """The family's chat template (Gemma 3's) for a GGUF whose metadata has none."""
    from halfmoon.engine.families import gguf_family

    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    try:
        return gguf_family(arch, "").chat_template
    except UnsupportedModelError:
        return None


def _backend_from_gguf(fields: dict[str, Any]) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the GGUF vocabulary, merges and token types."""
    tokens: list[str] = fields["tokens"]
    types: list[int] = fields.get("token_type") or [1] * len(tokens)
    pre = _pre_tokenizer(fields.get("pre", "gpt2"))  # files older than the `pre` key are gpt2
    # Added tokens keep their text so AddedToken(text) lands on the same id, not a new one.
    vocab = {t if ty in (_CONTROL, _USER_DEFINED) else _respell(t): i
             for i, (t, ty) in enumerate(zip(tokens, types))}
    # absent: no merges (a GGUF cannot store an empty array)
    merges = [tuple(m.split(" ", 1)) for m in fields.get("merges", [])]
    backend = BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are special: matched whole, skipped by decode(skip_special).
    # User-defined ones (<think>) are matched whole too but are ordinary text, as in llama.cpp.
    special = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == _CONTROL]
    backend.add_special_tokens(special)
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return backend


def _respell(token: str) -> str:
    """The token spelled in the byte alphabet the BPE model works in (a no-op if it already is)."""
    if all(c in _CHAR_TO_BYTE for c in token):
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _hf_piece_bytes(backend: BackendTokenizer, folder: Path) -> Callable[[str], bytes]:
    """How a `tokenizer.json`'s pieces spell bytes, from its decoder: byte-level, or
    SentencePiece with byte fallback (Gemma's Replace("▁", " ") + ByteFallback + Fuse)."""
    if isinstance(backend.decoder, decoders.ByteLevel):
        return _spelled_bytes
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = {d.get("type") for d in decoder.get("decoders", [])}
    if decoder.get("type") == "Sequence" and "ByteFallback" in parts:
        return _spm_bytes
    raise UnsupportedTokenizerError(f"{folder}/tokenizer.json is not byte-level BPE, nor SentencePiece "
                                    f"with byte fallback (decoder {decoder.get('type')!r})")


def _hf_family_template(folder: Path) -> str | None:
    """The family's chat template (Gemma 3's) for a HF folder that ships none."""
    from halfmoon.engine.families import hf_family

    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        return hf_family(json.loads(config.read_text("utf-8")), str(folder)).chat_template
    except (UnsupportedModelError, json.JSONDecodeError):
        return None


def _config_token(config: dict[str, Any], key: str) -> str | None:
    """`bos_token` / `eos_token` from tokenizer_config.json: a string or an AddedToken dict."""
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The chat template: `chat_template.jinja`, else tokenizer_config's string or named list."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _tojson(value: Any, indent: int | None = None) -> str:
    """HF's `tojson`: unlike jinja's own, it keeps non-ASCII text and does not HTML-escape."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the conversation: {message}")


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Every message must be a mapping with string `role` and `content`."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] is a {type(message).__name__}, not a dict")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ChatTemplateError(f"messages[{i}] needs a string {key!r}")


class Tokenizer:
    """A BPE tokenizer (byte-level or SentencePiece) with the model's special ids and chat template."""

    def __init__(self, backend: BackendTokenizer, *, eos_id: int, bos_id: int | None,
                 add_bos: bool, chat_template: str | None,
                 piece_bytes: Callable[[str], bytes] = _spelled_bytes) -> None:
        """`piece_bytes`: a vocabulary token's raw bytes (byte-level: `_spelled_bytes`;
        SentencePiece: `_spm_bytes`)."""
        if add_bos and bos_id is None:
            raise TokenizerError("add_bos_token is set but the model has no BOS token")
        self._backend = backend
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self._special = frozenset(i for i, tok in added.items() if tok.special)
        # Max id + 1, not a count: added-token ids may leave gaps after the model's vocabulary.
        self.vocab_size = max(backend.get_vocab_size(True), max(added, default=0) + 1)
        # Precomputed so streaming detokenization is a list index per token.
        self._bytes = [b""] * self.vocab_size
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            self._bytes[i] = text.encode("utf-8") if i in added else piece_bytes(text)
        turn_ends = (backend.token_to_id(t) for t in _TURN_END_TOKENS)
        self.stop_ids = frozenset({eos_id, *(i for i in turn_ends if i in self._special)})

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        from halfmoon.engine.gguf_header import read_header

        return cls.from_gguf_reader(read_header(path))

    @classmethod
    def from_gguf_reader(cls, reader: Any) -> Tokenizer:
        """Like `from_gguf`, from a header the weight loader already read (engine/gguf_header.py;
        a `gguf.GGUFReader` works too: both have `fields` with `contents()`)."""
        fields = _gguf_fields(reader)
        spm = fields["model"] == "llama"
        backend = _spm_backend_from_gguf(fields) if spm else _backend_from_gguf(fields)
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
        add_bos = fields.get("add_bos_token", spm)
        return cls(backend, eos_id=int(fields["eos_token_id"]),
                   bos_id=fields.get("bos_token_id"), add_bos=bool(add_bos),
                   chat_template=fields.get("chat_template") or _family_template(reader),
                   piece_bytes=_spm_bytes if spm else _spelled_bytes)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja` if present)."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
        piece_bytes = _hf_piece_bytes(backend, folder)
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}
        bos, eos = (_config_token(config, k) for k in ("bos_token", "eos_token"))
        bos_id = backend.token_to_id(bos) if bos else None
        eos_id = backend.token_to_id(eos) if eos else None
        if eos_id is None:
            raise TokenizerError(f"{folder}: no eos_token in tokenizer_config.json or vocabulary")
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):  # unstated: does tokenizer.json's post-processor add it?
            add_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
        template = _hf_chat_template(folder, config) or _hf_family_template(folder)
        return cls(backend, eos_id=eos_id, bos_id=bos_id, add_bos=add_bos, chat_template=template,
                   piece_bytes=piece_bytes)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in it become their single ids. A text
        that already starts with the BOS token (a chat template that writes it, as Gemma's does)
        gets no second one."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and ids[:1] != [self.bos_id]:
            if self.bos_id is None:
                raise TokenizerError("add_bos requested but the model has no BOS token")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; invalid utf-8 becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what a grammar engine builds its own from)."""
        return self._backend.to_str()

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a special token gives its utf-8 text)."""
        if not 0 <= token_id < self.vocab_size:  # a negative index would wrap silently
            raise TokenizerError(f"token id {token_id} not in 0..{self.vocab_size - 1}")
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens such as `<|im_start|>`, which decode skips by default."""
        return token_id in self._special

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render a conversation into prompt text with the model's template, as HF does
        (`tools`: OpenAI-shaped function tools, for a template that `takes_tools`)."""
        _check_messages(messages)
        extra = {"tools": list(tools)} if tools else {}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_id), eos_token=self._token_text(self.eos_id), **extra)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"chat template failed to render: {err}") from err

    @cached_property
    def takes_tools(self) -> bool:
        """The chat template renders a `tools` list itself (Qwen's, Llama 3.1's, Mistral's do;
        SmolLM2's and Gemma 3's do not)."""
        if self.chat_template is None:
            return False
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(self._environment().parse(self.chat_template))
        except jinja2.TemplateSyntaxError:
            return False

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        try:
            return self._environment().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"chat template does not parse: {err}") from err

    @staticmethod
    def _environment() -> ImmutableSandboxedEnvironment:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env

    def special_id(self, text: str) -> int | None:
        """The id of the special token spelled `text` (None: it is not one)."""
        i = self._backend.token_to_id(text)
        return i if i is not None and i in self._special else None

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.id_to_token(token_id) or ""


class IncrementalDetokenizer:
    """Generated ids -> text, one id at a time, never splitting a utf-8 character.

    Bytes of an incomplete character wait in the utf-8 decoder (at most 3) until the character
    completes, so each `push` costs O(token length), independent of the text so far.
    """

    __slots__ = ("_tokenizer", "_skip_special", "_keep", "_utf8", "_chunks")

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, keep: Collection[int] = ()) -> None:
        """`keep`: special tokens whose text is kept when the others are skipped."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._keep = frozenset(keep)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chunks: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        if self._skip_special and self._tokenizer.is_special(token_id) and token_id not in self._keep:
            return ""
        return self._emit(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def flush(self) -> str:
        """End of stream: return any withheld bytes, an incomplete character becoming U+FFFD."""
        return self._emit(self._utf8.decode(b"", final=True))

    @property
    def text(self) -> str:
        """All text returned by `push`/`flush` so far."""
        if len(self._chunks) > 1:  # join lazily, once per read, not once per token
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _emit(self, chunk: str) -> str:
        if chunk:
            self._chunks.append(chunk)
        return chunk
