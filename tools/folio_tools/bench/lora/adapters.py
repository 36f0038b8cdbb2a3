"""The adapters `folio bench lora` serves: seeded random PEFT LoRA adapters on every linear projection of
a Llama-family model (peft's "all-linear" minus the head), shaped from the model's own config, and the
config.json folder llama.cpp's converter reads as the base model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_model import gguf_model_config
from folio.models.registry import architecture_of

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def base_config(model: Path, folder: Path) -> dict[str, Any]:
    """The GGUF model's config as Hugging Face writes it, saved as `folder`/config.json; returned too."""
    gguf = GGUFFile(model)
    config = gguf_model_config(gguf)
    hf = architecture_of(config).config_to_hf(config)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    return hf


def projection_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear projection of a Llama-family layer."""
    hidden, heads, kv_heads = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    inter = hf["intermediate_size"]
    return {
        "q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
    }  # fmt: skip


def make_adapter(hf: dict[str, Any], folder: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter folder of rank `rank` on every projection of every layer (alpha = 2 * rank), its
    A scaled like a Kaiming init and its B small, so the model's text changes but stays text."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(hf["num_hidden_layers"]):
        for name, (out, inp) in projection_shapes(hf).items():
            block = "self_attn" if name in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) / inp**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [*ATTENTION, *MLP],
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "fan_in_fan_out": False}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder
