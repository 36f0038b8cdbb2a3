"""Builds a ready model and tokenizer from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from folio.config import ModelConfig
from folio.layers.linear import Linear
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_model import gguf_model_config, iter_gguf_weights
from folio.loaders.hf_folder import iter_safetensors, read_hf_config
from folio.loaders.tokenizer import Tokenizer
from folio.models.registry import model_class

QUANTIZATIONS = (None, "none", "int8", "int4")  # None: a GGUF file's own formats where kernels exist


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    quantization: str  # e.g. "Q4_1" for GGUF files, "none" for 16/32-bit checkpoints
    load_seconds: float

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the weights as held (packed 4-bit layers at their packed size)."""
        return resident_weight_bytes(self.model)


def resident_weight_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:  # tied weights count once
            seen.add(id(tensor))
            total += tensor.nbytes
    return total + sum(m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None)


def load_model(path: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None) -> LoadedModel:
    """`quantization`: None keeps a GGUF file's 4-bit projection weights packed where the device has a
    kernel for them (everything else is dequantized to `dtype`); "none" dequantizes everything; "int8"
    and "int4" quantize every projection on the fly after loading (per-channel int8; round-to-nearest
    4-bit in groups of 32), from any checkpoint."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, got {quantization!r}")
    start = time.perf_counter()
    if path.is_file():
        gguf = GGUFFile(path)
        config = gguf_model_config(gguf)
        weights = iter_gguf_weights(gguf, config, dtype, keep_quantized=quantization is None)
        tokenizer = Tokenizer.from_gguf(gguf)
        label = gguf.quantization_summary()
    elif (path / "config.json").exists():
        config = read_hf_config(path)
        weights = iter_safetensors(path)
        tokenizer = Tokenizer.from_hf_folder(path, extra_eos=config.eos_token_ids)
        label = "none"
    else:
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")
    config.eos_token_ids = sorted(set(config.eos_token_ids) | tokenizer.eos_token_ids)

    model = build_model(config, dtype, device)
    model.load_weights(weights)
    if quantization in ("int8", "int4"):
        count = sum(m.quantize(quantization) for m in model.modules() if isinstance(m, Linear))
        label = f"{label} -> {quantization} ({count} layers, on the fly)"
    return LoadedModel(model, config, tokenizer, path, label, time.perf_counter() - start)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Instantiate with parameters created directly in `dtype` (weights are filled by load_weights)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = model_class(config)(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device).eval()
