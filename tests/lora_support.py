"""PEFT LoRA adapters of the tiny family checkpoints (tests/model_families.py), made by `peft`
itself: random A and B at scales that move greedy decoding off the base model's tokens, saved as
every trainer saves them (`save_pretrained`: adapter_config.json + adapter_model.safetensors).
`peft_greedy` is the oracle: transformers + peft, fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.model_families import FamilyCase, hf_model

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(case: FamilyCase, folder: Path, seed: int, rank: int = 8,
                 targets: tuple[str, ...] = ALL_MODULES, alpha: float = 16.0, rslora: bool = False,
                 base_name: str | None = None) -> Any:
    """Write a LoRA adapter of `case`'s model to `folder`; returns the peft model (fp32, eval)."""
    from peft import LoraConfig, get_peft_model

    base = hf_model(case)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=rslora)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 / rank ** 0.5))
    model.peft_config["default"].base_model_name_or_path = base_name
    model.save_pretrained(folder)
    return model.eval()


@torch.inference_mode()
def peft_greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()

