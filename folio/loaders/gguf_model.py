"""GGUF metadata -> ModelConfig, and GGUF tensors -> (Hugging Face name, tensor) pairs.

What is architecture-specific comes from the architecture's `GGUFLayout` (folio/models/): its
metadata reader, its tensor names, and the conversions that undo what llama.cpp's converter did:
q/k rows permuted for GGML's interleaved RoPE (Llama; folio uses the rotate-half layout), and 1
added to norm weights (Gemma).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from folio.config import ModelConfig
from folio.loaders.gguf_file import GGUFFile, GGUFTensor
from folio.models.registry import GGUFLayout, gguf_architecture
from folio.weight_formats.gguf_dequant import dequantize_tensor, unpack
from folio.weight_formats.int4 import Int4Groups, int4_groups
from folio.weight_formats.int8 import Int8Groups, int8_groups

Q = GGMLQuantizationType
# 4- and 5-bit formats in groups of 32, kept as 4-bit tiles (plus a fifth bit plane) for projections.
INT4_FORMATS = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K})
# Symmetric formats whose codes fit int8 as they are (folio/weight_formats/int8.py): the embedding and LM head in
# Q5_0 too, whose rows an embedding lookup reads.
INT8_FORMATS = frozenset({Q.Q8_0, Q.Q6_K, Q.Q5_0})

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_layout(gguf: GGUFFile) -> GGUFLayout:
    layout = gguf_architecture(gguf.architecture).gguf
    assert layout is not None  # gguf_architecture finds only architectures with a layout
    return layout


def gguf_model_config(gguf: GGUFFile) -> ModelConfig:
    return gguf_layout(gguf).config_from_gguf(gguf)


def hf_name(gguf_name: str, layout: GGUFLayout) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in layout.top_names:
        return f"{layout.top_names[base]}.{suffix}"
    match = _BLOCK_RE.match(gguf_name)
    if not match or match.group(2) not in layout.block_names:
        raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, suffix = match.groups()
    return f"{layout.layer_prefix}.{layer}.{layout.block_names[part]}.{suffix}"


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _rope_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """The row index that undoes llama.cpp's q/k permutation (see _unpermute_rope_rows)."""
    return _unpermute_rope_rows(torch.arange(rows), num_heads)


def _rope_heads(name: str, layout: GGUFLayout, config: ModelConfig) -> int | None:
    """Heads of a q or k weight whose rows llama.cpp permuted, else None."""
    if not layout.permuted_rope_rows:
        return None
    if ".attn_q." in name:
        return config.num_heads
    return config.num_kv_heads if ".attn_k." in name else None


def _kept_groups(tensor: GGUFTensor, name: str, heads: int | None) -> Int4Groups | Int8Groups | None:
    """A projection weight whose format maps exactly onto 4-bit groups, kept that way; else a weight in a
    symmetric 5- to 8-bit format (Q8_0, Q6_K, and Q5_0 for the embedding), kept as 8-bit groups; else None."""
    to_int4 = not name.startswith("token_embd") and tensor.ggml_type in INT4_FORMATS
    if not to_int4 and tensor.ggml_type not in INT8_FORMATS:
        return None
    quant = unpack(tensor.data, tensor.ggml_type, tensor.shape)
    groups = int4_groups(quant, tensor.shape) if to_int4 else None
    if groups is None and tensor.ggml_type in INT8_FORMATS:
        groups = int8_groups(quant, tensor.shape)
    return groups if groups is None or heads is None else groups.rows(_rope_row_order(groups.shape[0], heads))


@dataclass(frozen=True)
class GGUFWeight:
    """One GGUF tensor, read when `load` is called: a tensor-parallel rank `narrow`s it to its rows or
    columns first (on the format's block boundaries), so it reads and unpacks only its slice."""

    tensor: GGUFTensor
    name: str  # the GGUF name
    rope_heads: int | None  # heads in these rows whose llama.cpp permutation is undone on load
    norm_offset: float
    keep_quantized: bool
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    def narrow(self, dim: int, start: int, size: int) -> GGUFWeight:
        rows, cols = self.tensor.shape
        block_size, type_size = GGML_QUANT_SIZES[self.tensor.ggml_type]
        raw = self.tensor.data.reshape(rows, cols // block_size, type_size)
        heads = self.rope_heads
        if dim == 0:
            if heads is not None:
                per_head = rows // heads
                if start % per_head or size % per_head:
                    raise ValueError(f"{self.name}: rows [{start}, {start + size}) split a rotary head")
                heads = size // per_head
            raw, shape = raw[start : start + size], (size, cols)
        else:
            if start % block_size or size % block_size:
                raise ValueError(f"{self.name}: columns [{start}, {start + size}) split its blocks of {block_size}")
            raw, shape = raw[:, start // block_size : (start + size) // block_size], (rows, size)
        return replace(self, tensor=GGUFTensor(self.name, shape, self.tensor.ggml_type, raw), rope_heads=heads)

    def load(self) -> torch.Tensor | Int4Groups | Int8Groups:
        tensor, heads = self.tensor, self.rope_heads
        if self.keep_quantized:
            groups = _kept_groups(tensor, self.name, heads)
            if groups is not None:
                return groups
        weight = dequantize_tensor(tensor, dtype=torch.float32)
        if heads is not None:
            weight = _unpermute_rope_rows(weight, heads)
        elif self.norm_offset and self.name.endswith("norm.weight"):
            weight = weight - self.norm_offset
        return weight.to(self.dtype)


def iter_gguf_weights(
    gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = True, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | Int4Groups | Int8Groups | GGUFWeight]]:
    """(Hugging Face name, weight) for every tensor. With `keep_quantized`, projection weights in a
    4- or 5-bit format come as Int4Groups and weights in Q8_0 or Q6_K (projections, embedding, LM head)
    or Q5_0 (embedding) as Int8Groups, for the layers to keep quantized; everything else is
    dequantized. With `lazy`, 2-D tensors come unread (`GGUFWeight`) for tensor-parallel layers to
    narrow before reading."""
    layout = gguf_layout(gguf)
    for name, tensor in gguf.tensors.items():
        weight = GGUFWeight(tensor, name, _rope_heads(name, layout, config), layout.norm_offset, keep_quantized, dtype)
        yield hf_name(name, layout), weight if lazy and len(tensor.shape) == 2 else weight.load()
