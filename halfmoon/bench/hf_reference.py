"""transformers' own model and tokenizer for a GGUF: the reference the engine is measured and
tested against, converted once per machine.

transformers converts a GGUF itself (dequantizing in Python: ~15-20 s for SmolLM2 on a 2-core
CPU, every time). The converted model and tokenizer are saved with transformers' own
`save_pretrained` under `$HALFMOON_CACHE_DIR/hf/<key>` (key: the GGUF's path, size and mtime and
the transformers version) and loaded from there afterwards: still transformers' conversion and
code, done once. A broken entry is logged, removed and converted again.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from halfmoon.core.cache_dir import cache_key, cache_root

log = logging.getLogger(__name__)


def _entry(gguf: Path, kind: str) -> Path:
    import transformers

    st = gguf.stat()
    shape = {"path": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
             "transformers": transformers.__version__, "kind": kind}
    return cache_root() / "hf" / cache_key(shape)


def hf_model(gguf: Path, dtype: torch.dtype) -> Any:
    """transformers' causal LM for `gguf` (or a HF folder) as `dtype`, in eval mode.

    transformers will not `save_pretrained` a model it loaded from a GGUF (it counts as
    quantized), so the entry is its config without the GGUF quantization marker and its
    converted state dict; loading builds the model from the config and assigns the tensors."""
    from transformers import AutoModelForCausalLM

    if gguf.is_dir():  # a HF folder: nothing to convert
        return AutoModelForCausalLM.from_pretrained(str(gguf), dtype=dtype).eval()
    model = _cached(_entry(gguf, "model"),
                    lambda: _Converted(AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                            dtype=torch.float32)),
                    _Converted.load)
    if isinstance(model, _Converted):  # converted just now
        model = model.model
    return model.to(dtype).eval()


class _Converted:
    """A GGUF-converted transformers model with a `save_pretrained` that works for it."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def save_pretrained(self, folder: str) -> None:
        config = self.model.config.to_dict()
        config.pop("quantization_config", None)
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(config))
        torch.save(self.model.state_dict(), Path(folder) / "weights.pt")

    @staticmethod
    def load(folder: Path) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = json.loads((folder / "config.json").read_text())
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                                 dtype=torch.float32)
        model.load_state_dict(torch.load(folder / "weights.pt", mmap=True, weights_only=True), strict=True, assign=True)
        return model


def hf_tokenizer(gguf: Path) -> Any:
    """transformers' tokenizer for `gguf`."""
    from transformers import AutoTokenizer

    return _cached(_entry(gguf, "tokenizer"),
                   lambda: AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name),
                   lambda path: AutoTokenizer.from_pretrained(str(path)))


def _cached(folder: Path, convert: Callable[[], Any], load: Callable[[Path], Any]) -> Any:
    if (folder / "config.json").is_file() or (folder / "tokenizer_config.json").is_file():
        try:
            return load(folder)
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            log.warning("hf reference cache: unreadable %s (%s): converting the GGUF again", folder, e)
            shutil.rmtree(folder, ignore_errors=True)
    obj = convert()
    tmp = folder.with_name(folder.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        obj.save_pretrained(str(tmp))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("hf reference cache: could not store %s (%s); every run converts again", folder, e)
    return obj
