"""A LoRA adapter in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read and laid
onto a model's layers.

PEFT names each matrix after the module it adapts in the base checkpoint
(`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`). The model's own checkpoint routing
(`checkpoint_rename`, then `stacked_params`) turns that module into folio's layer and part (q_proj ->
qkv_proj, part "q"), exactly as it loads the base weights. Each part gets A [r, in] and B [rows, r] and
its scale, lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from folio.layers.linear import Linear, MergedLinear
from folio.models.base import CausalLM, route_checkpoint_name

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM names it: `name` is how requests ask for it."""

    name: str
    path: str


@dataclass(frozen=True)
class LoRAPart:
    module: str  # folio's layer, e.g. "model.layers.3.self_attn.qkv_proj"
    part: int  # which of the layer's fused parts (0 for an unfused layer)
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [rows, r]
    scale: float


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int  # the largest of its matrices'
    parts: tuple[LoRAPart, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.parts)


def read_adapter_config(path: str | Path) -> dict:
    """A PEFT LoRA folder's adapter_config.json, checked for what folio serves (and its safetensors file
    checked to be there); ValueError with the reason otherwise. Reads no weights."""
    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder} is not a PEFT LoRA adapter: it has no {CONFIG}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder / CONFIG} is not valid JSON: {exc.msg}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{folder / CONFIG} must hold a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{folder} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    refused = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2's Conv1D layout)",
        "modules_to_save": "adapters that replace whole modules (modules_to_save)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{folder}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{folder}: adapters with trained biases (bias={config['bias']!r}) are not supported")
    if not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} has no {WEIGHTS} (only safetensors adapters are read)")
    return config


def _layer_parts(layer: Linear) -> list[object]:
    return list(layer.shard_offsets) if isinstance(layer, MergedLinear) else [None]


def read_adapter(name: str, path: str | Path, model: CausalLM) -> LoRAAdapter:
    """The adapter at `path`, its matrices matched to `model`'s layers; ValueError naming what does not fit."""
    folder = Path(path).expanduser()
    config = read_adapter_config(folder)
    tensors = load_file(str(folder / WEIGHTS))
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora", False))
    modules = dict(model.named_modules())
    parts = []
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        module_name = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"{folder}: {key} has no lora_B matrix beside it")
        a = tensors[key]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"{folder}: {module_name}'s matrices have shapes {tuple(a.shape)} and {tuple(b.shape)}")
        target, shard_id = route_checkpoint_name(model, f"{module_name}.weight", b)
        layer = modules.get(target.removesuffix(".weight"))
        if not isinstance(layer, Linear):
            raise ValueError(f"{folder}: {module_name} is not a linear layer of this model; LoRA adapts the "
                             "attention and MLP projections")  # fmt: skip
        part_ids = _layer_parts(layer)
        rank = a.shape[0]
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        module = target.removesuffix(".weight")
        if shard_id in part_ids:
            parts.append(LoRAPart(module, part_ids.index(shard_id), a.float(), b.float(), scale))
        elif shard_id is None:  # the whole of a fused layer (Phi-3's checkpoint fuses q|k|v): each part its rows
            if b.shape[0] != layer.out_features:
                raise ValueError(f"{folder}: {module_name}'s B has {b.shape[0]} rows, the layer {layer.out_features}")
            for index, part_id in enumerate(part_ids):
                first, rows = layer.shard_rows(part_id)
                parts.append(LoRAPart(module, index, a.float(), b[first : first + rows].float(), scale))
        else:
            raise ValueError(f"{folder}: {module_name} does not match a part of {module}")
    if not parts:
        raise ValueError(f"{folder}: the adapter holds no LoRA matrices")
    return LoRAAdapter(name, folder, max(p.a.shape[0] for p in parts), tuple(parts))


def layer_parts(layer: nn.Module) -> list[tuple[int, int]]:
    """(first output row, rows) of each of a linear layer's parts, as LoRASlots takes them."""
    assert isinstance(layer, Linear)
    return [layer.shard_rows(part) for part in _layer_parts(layer)]
