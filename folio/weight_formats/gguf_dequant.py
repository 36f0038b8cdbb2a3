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

A k-quant super-block (Q4_K, Q5_K, Q6_K) holds 256 values: one f16 super-scale (and super-min) plus
small integer scales per sub-block of 32 (Q4_K, Q5_K) or 16 (Q6_K) values. Multiplying the two out
gives every sub-block an ordinary float32 scale and bias, exact in float32's 24-bit mantissa, so
k-quants share the groups of the legacy formats. Byte layouts follow ggml-common.h's block_q*.
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

if TYPE_CHECKING:  # an annotation only: the loaders sit above the weight formats
    from folio.loaders.gguf_file import GGUFTensor

Q = GGMLQuantizationType
# (codes [n_groups, group_size], scales [n_groups, 1] float32, biases [n_groups, 1] float32 or None)
Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


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


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte `offset` of every block, as a float32 column [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _bit_planes(packed: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """(packed[..., None, :] >> s) & mask for each s in `shifts`, stacked on a new second-last axis."""
    shift = torch.tensor(list(shifts), dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shift) & mask


# -- legacy block formats: 32 values per block, one group per block ----------------------------------


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: element i is the low nibble of byte i, element 16+i its high nibble."""
    return _bit_planes(qs, range(0, 8, 4), 15).flatten(1)


# Byte -> eight bytes (packed in an int64), the k-th holding bit k of the byte moved to bit 4. One
# table lookup per qh byte is ~4x faster than broadcasting shifts and transposing the bit planes.
_FIFTH_BIT_TABLE = (((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1) << (8 * torch.arange(8) + 4)).sum(1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) -> bit i for each of the 32 elements, shifted to bit 4."""
    table = _FIFTH_BIT_TABLE.to(qh.device)
    return torch.index_select(table, 0, qh.reshape(-1).to(torch.int32)).view(torch.uint8).view(-1, 32)


def _unpack_q4_0(blocks: torch.Tensor) -> Unpacked:
    # d (f16) | 16 bytes of nibbles; value = d * (q - 8)
    return _nibbles(blocks[:, 2:18]).view(torch.int8) - 8, _f16_field(blocks, 0), None


def _unpack_q4_1(blocks: torch.Tensor) -> Unpacked:
    # d, m (f16) | 16 bytes of nibbles; value = d * q + m
    return _nibbles(blocks[:, 4:20]), _f16_field(blocks, 0), _f16_field(blocks, 2)


def _unpack_q5_0(blocks: torch.Tensor) -> Unpacked:
    # d (f16) | qh (32 fifth bits) | 16 bytes of nibbles; value = d * (q - 16)
    codes = _nibbles(blocks[:, 6:22]) | _fifth_bits(blocks[:, 2:6])
    return codes.view(torch.int8) - 16, _f16_field(blocks, 0), None


def _unpack_q5_1(blocks: torch.Tensor) -> Unpacked:
    # d, m (f16) | qh (32 fifth bits) | 16 bytes of nibbles; value = d * q + m
    codes = _nibbles(blocks[:, 8:24]) | _fifth_bits(blocks[:, 4:8])
    return codes, _f16_field(blocks, 0), _f16_field(blocks, 2)


def _unpack_q8_0(blocks: torch.Tensor) -> Unpacked:
    # d (f16) | 32 int8; value = d * q
    return blocks[:, 2:34].view(torch.int8), _f16_field(blocks, 0), None


# -- k-quants: super-blocks of 256 values, groups of 32 (Q4_K, Q5_K) or 16 (Q6_K) ---------------------


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight 6-bit scales and eight 6-bit mins from the 12 bytes Q4_K and Q5_K share.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; scales and mins 4-7
    take their low 4 bits from bytes 8-11 and their top 2 bits from the spare top bits of bytes 0-7.
    """
    p = packed.reshape(-1, 3, 4)
    sc_lo, mn_lo, extra = p[:, 0], p[:, 1], p[:, 2]
    scales = torch.cat([sc_lo & 63, (extra & 15) | ((sc_lo >> 2) & 48)], dim=1)
    mins = torch.cat([mn_lo & 63, (extra >> 4) | ((mn_lo >> 2) & 48)], dim=1)
    return scales, mins


def _k4_groups(blocks: torch.Tensor, qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-nibble codes and per-32 scales/biases common to Q4_K and Q5_K."""
    n = blocks.shape[0]
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    group_scales = (_f16_field(blocks, 0) * scales).reshape(-1, 1)
    group_biases = (_f16_field(blocks, 2) * mins).neg_().reshape(-1, 1)
    # Each 32-byte chunk of qs holds two sub-blocks: low nibbles first, then high nibbles.
    low = _bit_planes(qs.reshape(n, 4, 32), range(0, 8, 4), 15)  # [n, 4, 2, 32]
    return low.reshape(n * 8, 32), group_scales, group_biases


def _unpack_q4_k(blocks: torch.Tensor) -> Unpacked:
    """Q4_K (144 bytes): d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.

    value = d*scale_j * q - dmin*min_j, q in [0, 15], groups of 32.
    """
    return _k4_groups(blocks, blocks[:, 16:144])


def _unpack_q5_k(blocks: torch.Tensor) -> Unpacked:
    """Q5_K (176 bytes): as Q4_K plus 32 bytes whose bit j is the fifth bit of sub-block j's codes."""
    n = blocks.shape[0]
    low, scales, biases = _k4_groups(blocks, blocks[:, 48:176])
    high = _bit_planes(blocks[:, 16:48], range(8), 1)  # [n, 8, 32]
    return low | (high.reshape(n * 8, 32) << 4), scales, biases


def _unpack_q6_k(blocks: torch.Tensor) -> Unpacked:
    """Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d (f16).

    value = d*scale_j * (q - 32), q in [0, 63], groups of 16.
    """
    n = blocks.shape[0]
    # Each half (128 values) uses 64 bytes of ql (low nibbles, then high nibbles) and 32 bytes of qh
    # (four 2-bit planes, one per 32 values).
    low = _bit_planes(blocks[:, :128].reshape(n, 2, 64), range(0, 8, 4), 15).reshape(n, 8, 32)
    high = _bit_planes(blocks[:, 128:192].reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 8, 32)
    codes = (low | (high << 4)).view(torch.int8) - 32
    scales = _f16_field(blocks, 208) * blocks[:, 192:208].view(torch.int8)
    return codes.reshape(n * 16, 16), scales.reshape(-1, 1), None


# format -> (unpacker, bits per code)
_BLOCK_FORMATS: dict[GGMLQuantizationType, tuple[Callable[[torch.Tensor], Unpacked], int]] = {
    Q.Q4_0: (_unpack_q4_0, 4),
    Q.Q4_1: (_unpack_q4_1, 4),
    Q.Q5_0: (_unpack_q5_0, 5),
    Q.Q5_1: (_unpack_q5_1, 5),
    Q.Q8_0: (_unpack_q8_0, 8),
    Q.Q4_K: (_unpack_q4_k, 4),
    Q.Q5_K: (_unpack_q5_k, 5),
    Q.Q6_K: (_unpack_q6_k, 6),
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
