"""Vectorized PyTorch dequantization of GGUF tensor bytes.

Every supported block format is first unpacked into affine groups, `GroupQuant`:

    value = scales[g] * codes[g, i] + biases[g]      (biases is None for symmetric formats)

with small integer codes (int8 when the format subtracts a fixed offset, else uint8), one float32
scale (and bias) per group of 32 values (16 for Q6_K). That form is what a quantized linear layer
needs to repack into an int8/int4 kernel, and dequantizing is one cast, one multiply and one add.

All work is torch ops on the raw bytes, vectorized over chunks of ~1M values (no Python loop over
blocks), so it also runs on a CUDA tensor of bytes. Results equal `gguf.quants.dequantize` exactly:
the f16 scales have 11 significant bits and the codes at most 8, so every product is exact in float32
and only the final add of a bias rounds, as it does in ggml.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from folio.weight_formats import gguf_kquants
from folio.weight_formats.gguf_kquants import Unpacked, bit_planes, f16_field

if TYPE_CHECKING:  # an annotation only: the loaders sit above the weight formats
    from folio.loaders.gguf_file import GGUFTensor

Q = GGMLQuantizationType


@dataclass(frozen=True)
class GroupQuant:
    """A quantized tensor as affine groups; see the module docstring for the meaning."""

    codes: torch.Tensor  # [n_groups, group_size] int8 or uint8, in element order; may view the input
    scales: torch.Tensor  # [n_groups, 1] float32
    biases: torch.Tensor | None  # [n_groups, 1] float32
    bits: int  # codes fit in this many bits (signed when codes are int8)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1]

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Flat values in element order; written into `out` (flat, any float dtype) when given."""
        direct = out is not None and out.dtype == torch.float32
        values = out.view(self.codes.shape).copy_(self.codes) if direct else self.codes.to(torch.float32)
        values.mul_(self.scales)
        if self.biases is not None:
            values.add_(self.biases)
        if out is None or direct:
            return values.view(-1)
        return out.copy_(values.view(-1))  # the one rounding to a narrower dtype


# -- legacy block formats: 32 values per block, one group per block ----------------------------------


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: element i is the low nibble of byte i, element 16+i its high nibble."""
    return bit_planes(qs, range(0, 8, 4), 15).flatten(1)


# Byte -> eight bytes (packed in an int64), the k-th holding bit k of the byte moved to bit 4. One
# table lookup per qh byte is ~4x faster than broadcasting shifts and transposing the bit planes.
_FIFTH_BIT_TABLE = (((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1) << (8 * torch.arange(8) + 4)).sum(1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) -> bit i for each of the 32 elements, shifted to bit 4."""
    table = _FIFTH_BIT_TABLE.to(qh.device)
    return torch.index_select(table, 0, qh.reshape(-1).to(torch.int32)).view(torch.uint8).view(-1, 32)


def _unpack_q4_0(blocks: torch.Tensor) -> Unpacked:
    # d (f16) | 16 bytes of nibbles; value = d * (q - 8)
    return _nibbles(blocks[:, 2:18]).view(torch.int8) - 8, f16_field(blocks, 0), None


def _unpack_q4_1(blocks: torch.Tensor) -> Unpacked:
    # d, m (f16) | 16 bytes of nibbles; value = d * q + m
    return _nibbles(blocks[:, 4:20]), f16_field(blocks, 0), f16_field(blocks, 2)


def _unpack_q5_0(blocks: torch.Tensor) -> Unpacked:
    # d (f16) | qh (32 fifth bits) | 16 bytes of nibbles; value = d * (q - 16)
    codes = _nibbles(blocks[:, 6:22]) | _fifth_bits(blocks[:, 2:6])
    return codes.view(torch.int8) - 16, f16_field(blocks, 0), None


def _unpack_q5_1(blocks: torch.Tensor) -> Unpacked:
    # d, m (f16) | qh (32 fifth bits) | 16 bytes of nibbles; value = d * q + m
    codes = _nibbles(blocks[:, 8:24]) | _fifth_bits(blocks[:, 4:8])
    return codes, f16_field(blocks, 0), f16_field(blocks, 2)


def _unpack_q8_0(blocks: torch.Tensor) -> Unpacked:
    # d (f16) | 32 int8; value = d * q
    return blocks[:, 2:34].view(torch.int8), f16_field(blocks, 0), None


# format -> (unpacker, bits per code)
_BLOCK_FORMATS: dict[GGMLQuantizationType, tuple[Callable[[torch.Tensor], Unpacked], int]] = {
    Q.Q4_0: (_unpack_q4_0, 4),
    Q.Q4_1: (_unpack_q4_1, 4),
    Q.Q5_0: (_unpack_q5_0, 5),
    Q.Q5_1: (_unpack_q5_1, 5),
    Q.Q8_0: (_unpack_q8_0, 8),
    Q.Q4_K: (gguf_kquants.unpack_q4_k, 4),
    Q.Q5_K: (gguf_kquants.unpack_q5_k, 5),
    Q.Q6_K: (gguf_kquants.unpack_q6_k, 6),
}
_FLOAT_FORMATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
_CHUNK_ELEMENTS = 1 << 20
SUPPORTED_TYPES = frozenset(_BLOCK_FORMATS) | frozenset(_FLOAT_FORMATS)


# -- public API -------------------------------------------------------------------------------------


def _as_bytes(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over `data`'s bytes (no copy when already contiguous)."""
    if isinstance(data, np.ndarray):
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        # GGUF tensors are read-only memory maps; we only ever read them, never write through.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(flat)
    return data.contiguous().view(-1).view(torch.uint8)


def _checked_blocks(data: np.ndarray | torch.Tensor, ggml_type: Q, shape: tuple[int, ...]) -> torch.Tensor:
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"GGML type {ggml_type.name} is not supported for dequantization")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    numel = math.prod(shape)
    raw = _as_bytes(data)
    if numel % block_size or raw.numel() != numel // block_size * type_size:
        raise ValueError(f"{raw.numel()} bytes of {ggml_type.name} do not hold a tensor of shape {tuple(shape)}")
    return raw.view(-1, type_size)


def unpack(data: np.ndarray | torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> GroupQuant:
    """Unpack the bytes of a block-quantized tensor into affine groups (float formats raise)."""
    ggml_type = Q(ggml_type)
    if ggml_type in _FLOAT_FORMATS:
        raise ValueError(f"{ggml_type.name} is a float format; it has no quantized groups")
    blocks = _checked_blocks(data, ggml_type, shape)
    unpacker, bits = _BLOCK_FORMATS[ggml_type]
    codes, scales, biases = unpacker(blocks)
    return GroupQuant(codes, scales, biases, bits)


def dequantize(
    data: np.ndarray | torch.Tensor,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize raw GGUF tensor bytes to a new tensor of `shape` (row-major, torch order) and `dtype`.

    Block formats are computed in float32 and rounded once to `dtype`. The result never aliases
    `data`, so it is safe to write to even when `data` is a read-only memory map.
    """
    ggml_type = Q(ggml_type)
    blocks = _checked_blocks(data, ggml_type, shape)
    if ggml_type in _FLOAT_FORMATS:
        values = blocks.view(-1).view(_FLOAT_FORMATS[ggml_type])
        return values.to(dtype, copy=True).view(shape)
    unpacker, bits = _BLOCK_FORMATS[ggml_type]
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    out = torch.empty(math.prod(shape), dtype=dtype, device=blocks.device)
    # Chunks keep the byte-sized temporaries in cache and bound the float32 scratch space when
    # `dtype` is narrower; whole-tensor ops would briefly need several times the output's memory.
    step = _CHUNK_ELEMENTS // block_size
    for start in range(0, blocks.shape[0], step):
        chunk = GroupQuant(*unpacker(blocks[start : start + step]), bits)
        chunk.dequantize(out[start * block_size : (start + step) * block_size])
    return out.view(shape)


def dequantize_tensor(t: GGUFTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a tensor of a GGUFFile to its PyTorch shape."""
    return dequantize(t.data, t.ggml_type, t.shape, dtype)
