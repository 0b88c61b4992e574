"""engine/gguf_header.py against gguf's own reader on the real SmolLM2 file: the same metadata
values and tensor infos; a broken file is a ModelLoadError."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.gguf_header import read_header
from halfmoon.engine.loader import resolve_model_path


def test_the_header_matches_ggufs_reader_on_the_real_model() -> None:
    path = resolve_model_path("smollm2")
    ours, theirs = read_header(path), gguf.GGUFReader(path)
    header_keys = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # gguf's reader adds these
    assert set(ours.fields) == set(theirs.fields) - header_keys
    for key, field in theirs.fields.items():
        if key not in header_keys:
            assert ours.fields[key].contents() == field.contents(), key
    assert ours.version == theirs.fields["GGUF.version"].contents()
    assert [(t.name, t.shape, t.ggml_type) for t in ours.tensors] == \
        [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in theirs.tensors]
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_a_truncated_or_foreign_file_is_a_model_load_error(tmp_path: Path) -> None:
    real = resolve_model_path("smollm2").read_bytes()[:200_000]
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(real[:5000])
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF"):
        read_header(truncated)
    foreign = tmp_path / "not.gguf"
    foreign.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_header(foreign)
