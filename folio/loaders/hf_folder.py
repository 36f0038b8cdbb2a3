"""Hugging Face model folders: config.json and memory-mapped *.safetensors, and quantized ones.

A quantized folder (GPTQ and AWQ checkpoints from `folio quantize` or elsewhere, and folio's own NF4
layout) names its method in config.json's `quantization_config`. A quantized layer's tensors share a
prefix (`model.layers.0.self_attn.q_proj.qweight`, `.qzeros`, `.scales`, `.g_idx`); they are gathered
and yielded as one weight under `<prefix>.weight`, so the model's ordinary weight routing applies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from folio.config import ModelConfig
from folio.models.registry import config_from_hf
from folio.weight_formats.checkpoint_layouts import to_kernel_form, unpack_awq, unpack_gptq
from folio.weight_formats.nf4 import NF4Weight


def read_hf_config(folder: Path) -> ModelConfig:
    """config.json read by the module of the architecture it names (folio/models/)."""
    raw: dict[str, Any] = json.loads((folder / "config.json").read_text())
    if not raw.get("architectures"):
        raise ValueError(f"{folder}/config.json names no architecture")
    return config_from_hf(raw)


def _safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _safetensors_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


METHODS = ("gptq", "awq", "folio_nf4")
_MARKERS = {"gptq": "qweight", "awq": "qweight", "folio_nf4": "weight_nf4"}
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "folio_nf4": ("weight_nf4", "weight_absmax_codes", "weight_absmax_scales", "weight_absmax_offset", "weight_shape"),
}


@dataclass
class QuantizationConfig:
    method: str  # "gptq" | "awq" | "folio_nf4"
    bits: int
    group_size: int  # -1: one group per row
    zero_offset: int  # GPTQ v1 stores zero points minus one

    @property
    def label(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method} {self.bits}-bit {group}"


def read_quantization_config(folder: Path) -> QuantizationConfig | None:
    raw: dict[str, Any] = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if not raw:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"quantization method {method!r} is not supported; folio loads {', '.join(METHODS)}")
    bits = int(raw.get("bits", raw.get("w_bit", 4)))
    if method == "awq" and (bits != 4 or str(raw.get("version", "gemm")).lower() != "gemm"):
        raise ValueError("folio loads 4-bit AWQ checkpoints in the GEMM layout only")
    if method == "gptq" and bits not in (2, 4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (2, 4 and 8 are)")
    v2 = method == "gptq" and str(raw.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    group_size = int(raw.get("group_size", raw.get("q_group_size", raw.get("block_size", 128))))
    return QuantizationConfig(method, bits, group_size, zero_offset=1 if method == "gptq" and not v2 else 0)


def iter_quantized_safetensors(
    folder: Path, config: QuantizationConfig, dequantize: bool = False
) -> Iterator[tuple[str, Any]]:
    """(name, dense tensor or quantized weight) for every layer of the checkpoint; with `dequantize`,
    every quantized weight comes as an exact float32 tensor instead."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(path), framework="pt")) for path in _safetensors_files(folder)]
        where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118
        marker, parts = _MARKERS[config.method], _PARTS[config.method]
        prefixes = {name[: -len(marker) - 1] for name in where if name.endswith("." + marker)}
        grouped = {f"{prefix}.{part}" for prefix in prefixes for part in parts}
        for name, handle in where.items():
            if name not in grouped:
                yield name, handle.get_tensor(name)
            elif name.endswith("." + marker):
                prefix = name[: -len(marker) - 1]
                tensors = {p: where[f"{prefix}.{p}"].get_tensor(f"{prefix}.{p}") for p in parts
                           if f"{prefix}.{p}" in where}  # fmt: skip
                yield f"{prefix}.weight", _quantized_weight(tensors, config, prefix, dequantize)


def _quantized_weight(tensors: dict[str, torch.Tensor], config: QuantizationConfig, prefix: str,
                      dequantize: bool) -> Any:  # fmt: skip
    if config.method == "folio_nf4":
        weight = NF4Weight.from_tensors(tensors)
        return weight.dequantize() if dequantize else weight
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in tensors]
    if missing:
        raise ValueError(f"{prefix}: quantized layer lacks {', '.join(missing)}")
    awq = config.method == "awq"
    groups = unpack_awq(tensors) if awq else unpack_gptq(tensors, config.bits, config.zero_offset)
    return groups.dequantize() if dequantize else to_kernel_form(groups)
