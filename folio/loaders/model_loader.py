"""Builds a ready model and tokenizer from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from folio.config import ModelConfig
from folio.distributed.pipeline_parallel import current_stage
from folio.distributed.tensor_parallel import current as current_tp
from folio.layers.linear import ON_THE_FLY_METHODS, Linear
from folio.loaders import hf_folder
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_model import gguf_model_config, iter_gguf_weights
from folio.loaders.tokenizer import Tokenizer
from folio.memory import gather_weights
from folio.models.registry import model_class

logger = logging.getLogger("folio")

# None: the checkpoint's own formats (GGUF blocks, GPTQ, AWQ, NF4) kept where kernels exist.
QUANTIZATIONS = (None, "none", "int8", "int4", "nf4")


@dataclass
class LoadedModel:
    model: nn.Module | None  # None: tensor-parallel ranks hold it, each its shard, in their processes
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    quantization: str  # e.g. "Q4_1" for GGUF files, "none" for 16/32-bit checkpoints
    load_seconds: float
    shard_bytes: int = 0  # with ranks: what rank 0 holds

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the weights as held (packed 4-bit layers at their packed size); with
        ranks, rank 0's shard."""
        return resident_weight_bytes(self.model) if self.model is not None else self.shard_bytes

    def step_weight_bytes(self, greedy: bool = True) -> int:
        """The weight bytes a decode step reads (what MBU counts): the resident ones, but where a packed
        weight holds a copy for greedy steps (an LM head's six-bit first pass, int8.py) only what the
        step reads of the two; with ranks, rank 0's resident shard."""
        return resident_weight_bytes(self.model, greedy) if self.model is not None else self.shard_bytes


def resident_weight_bytes(model: nn.Module, greedy: bool | None = None) -> int:
    """Bytes of the model's weights as held; with `greedy` given, packed ones as a greedy (True) or
    sampled (False) decode step reads them."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:  # tied weights count once
            seen.add(id(tensor))
            total += tensor.nbytes
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    return total + sum(p.nbytes if greedy is None else p.step_nbytes(greedy) for p in packed)


@dataclass
class Checkpoint:
    """A model file opened: its config, tokenizer and format, and its weights still unread."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    label: str
    weights: Iterator[tuple[str, Any]]  # read lazily, tensor by tensor, as the model loads them


def open_checkpoint(path: Path, dtype: torch.dtype, quantization: str | None = None) -> Checkpoint:
    """Read a checkpoint's config and tokenizer; its weights are read only when iterated (an engine
    whose ranks load the weights reads no weight in its own process)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, got {quantization!r}")
    if path.is_file():
        gguf = GGUFFile(path)
        config = gguf_model_config(gguf)
        # A tensor-parallel rank reads only its slice of each tensor (the layers narrow them), and a
        # pipeline stage only its layers' tensors.
        split = current_tp().size > 1 or current_stage().size > 1
        weights = iter_gguf_weights(gguf, config, dtype, keep_quantized=quantization is None, lazy=split)
        tokenizer = Tokenizer.from_gguf(gguf)
        label = gguf.quantization_summary()
    elif (path / "config.json").exists():
        config = hf_folder.read_hf_config(path)
        checkpoint_quant = hf_folder.read_quantization_config(path)
        if checkpoint_quant is None:
            weights, label = hf_folder.iter_safetensors(path), "none"
        else:
            if quantization in ON_THE_FLY_METHODS:
                raise ValueError(f"{path} is already quantized ({checkpoint_quant.label}); load it as it is or "
                                 "with quantization 'none'")  # fmt: skip
            weights = hf_folder.iter_quantized_safetensors(path, checkpoint_quant, dequantize=quantization == "none")
            label = checkpoint_quant.label
        tokenizer = Tokenizer.from_hf_folder(path, extra_eos=config.eos_token_ids)
    else:
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")
    config.eos_token_ids = sorted(set(config.eos_token_ids) | tokenizer.eos_token_ids)
    return Checkpoint(path, config, tokenizer, label, weights)


def load_model(path: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None) -> LoadedModel:
    """`quantization`: None keeps a checkpoint's quantized weights (a GGUF file's 4-bit projections and
    Q8_0 embedding; GPTQ, AWQ and NF4 folders) where the device has a kernel for them (everything else
    is dequantized to `dtype`); "none" dequantizes a GGUF file; "int8", "int4" and "nf4" quantize every
    projection of an unquantized checkpoint on the fly after loading (per-channel int8; round-to-nearest
    4-bit in groups of 32; NF4 in blocks of 64). Built inside `building(tp)`, the model holds only
    its tensor-parallel rank's shard of every weight."""
    start = time.perf_counter()
    checkpoint = open_checkpoint(path, dtype, quantization)
    config, label = checkpoint.config, checkpoint.label
    model = build_model(config, dtype, device)
    model.load_weights(checkpoint.weights)
    if quantization in ON_THE_FLY_METHODS:
        count = sum(m.quantize(quantization) for m in model.modules() if isinstance(m, Linear))
        label = f"{label} -> {quantization} ({count} layers, on the fly)"
    if device.type == "cpu":
        arena = gather_weights(model)
        if arena is not None:
            logger.info("%s", arena.describe())
    return LoadedModel(model, config, checkpoint.tokenizer, path, label, time.perf_counter() - start)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Instantiate with parameters created directly in `dtype` (weights are filled by load_weights)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = model_class(config)(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device).eval()
