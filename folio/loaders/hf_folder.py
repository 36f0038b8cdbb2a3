"""Hugging Face model folders: config.json and memory-mapped *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from folio.config import ModelConfig
from folio.models.registry import config_from_hf


def read_hf_config(folder: Path) -> ModelConfig:
    """config.json read by the module of the architecture it names (folio/models/)."""
    raw: dict[str, Any] = json.loads((folder / "config.json").read_text())
    if not raw.get("architectures"):
        raise ValueError(f"{folder}/config.json names no architecture")
    return config_from_hf(raw)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)
