"""4-bit (and 5-bit) weights in groups along K, kept packed in memory and multiplied without being widened.

`Int4Groups` is the unpacked form a loader produces: w[n, k] = (codes[n, k] - 8) * scales[n, g] +
zeros[n, g], with g = k // group_size (32, or a multiple of 64: 64, 128, 256) and codes of `bits` bits
(4, or 5). GGUF's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1 and Q5_K (groups of 32) and GPTQ/AWQ checkpoints without
act-order map onto it exactly, so these tensors load without ever being widened to 16/32 bits.

`PackedInt4` holds half a byte per weight, tiled by 16 rows, plus float16 scales and mins (Q4_1's
own fields); 5-bit codes add their fifth bits as one bit plane (an eighth of a byte per weight). It
multiplies by the int8 dot-product kernel (int8_dot.py) for a few rows, or widens the weight in C++
and runs one GEMM for more. The kernel rounds activations to 8 bits in blocks of 32, as llama.cpp
does for its 4-bit dot products. `LLM(quantization="none")` keeps everything in full precision.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from folio import ops
from folio.weight_formats.gguf_dequant import GroupQuant
from folio.weight_formats.int8_dot import (
    tile_codes,
    tile_fifth_bits,
    tile_groups,
    untile_codes,
    untile_fifth_bits,
    untile_groups,
)

GROUP_SIZE = 32  # GGUF's 4-bit formats, and the default of round-to-nearest
# Rows up to which the dot-product kernel beats widening the weight for one GEMM, by activation dtype.
# float32: every row count. On 2 threads the kernel runs 235-330 GFLOP/s from 64 to 1,024 rows (3072x576,
# 4096x640 and 576x1536 weights), against 110-200 for widening + a float32 GEMM and 150-200 for a
# float32 GEMM on an already dense weight. bfloat16: up to 64 rows (303 / 315 against 285 / 291 GFLOP/s
# at 64 rows; 306 / 317 against 353 / 350 at 128), where bf16 GEMMs overtake it (development
# measurements, noisy to ~10%).
DOT_MAX_ROWS_BF16 = 64


def dot_max_rows(dtype: torch.dtype) -> int:
    """The most activation rows of `dtype` the dot-product kernel is picked for."""
    return sys.maxsize if dtype == torch.float32 else DOT_MAX_ROWS_BF16


@dataclass
class Int4Groups:
    codes: torch.Tensor  # [N, K] uint8, 0..15 (0..31 with 5 bits)
    scales: torch.Tensor  # [N, K / 32] float32
    zeros: torch.Tensor  # [N, K / 32] float32
    bits: int = 4  # 4, or 5: the codes' width

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @classmethod
    def cat_rows(cls, parts: list[Int4Groups]) -> Int4Groups:
        joined = (torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros"))
        return cls(*joined, bits=max(p.bits for p in parts))

    def rows(self, index: torch.Tensor) -> Int4Groups:
        """The same weight with its output rows reordered (e.g. undoing llama.cpp's q/k permutation)."""
        return replace(self, codes=self.codes[index], scales=self.scales[index], zeros=self.zeros[index])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
        return ((self.codes.float() - 8) * scales + zeros).to(dtype)


def rtn_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Groups:
    """Round-to-nearest 4-bit, asymmetric, in groups along K: each group's [min, max] in 16 steps."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // group_size, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(1e-8)
    codes = ((grouped - low.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    # value = low + code * scale = (code - 8) * scale + (low + 8 * scale)
    return Int4Groups(codes.view(rows, cols), scales, low + 8 * scales)


def int4_groups(quant: GroupQuant, shape: tuple[int, ...]) -> Int4Groups | None:
    """A GGUF tensor's groups as Int4Groups, or None if its format does not map onto them exactly
    (more than 5 bits, groups other than 32) or its shape does not suit the kernel."""
    if quant.bits not in (4, 5) or quant.group_size != GROUP_SIZE or len(shape) != 2:
        return None
    rows, cols = shape
    if cols % GROUP_SIZE:
        return None
    scales = quant.scales.view(rows, cols // GROUP_SIZE)
    if quant.codes.dtype == torch.int8:  # symmetric formats store code - offset (8, or 16 with 5 bits)
        offset = 1 << (quant.bits - 1)
        codes = (quant.codes.to(torch.int16) + offset).to(torch.uint8)
        zeros = scales * (8 - offset)  # scale * (code - offset) = (code - 8) * scale + (8 - offset) * scale
    else:  # value = scale * code + bias = (code - 8) * scale + (bias + 8 * scale)
        codes = quant.codes
        zeros = scales * 8
    if quant.biases is not None:
        zeros = zeros + quant.biases.view(rows, cols // GROUP_SIZE)
    return Int4Groups(codes.reshape(rows, cols).contiguous(), scales.contiguous(), zeros.contiguous(), quant.bits)


class PackedInt4:
    """A [N, K] weight held as half a byte per value, tiled by 16 rows for the int8 dot-product kernel
    (`int8_dot.tile_codes`), with float16 scales and mins per group, W = code * scale + min; 5-bit codes
    also hold their fifth bits (`high_bits`, `int8_dot.tile_fifth_bits`; empty for 4 bits). It is
    multiplied by that kernel for a few rows, or widened in C++ for one GEMM for more. Without a
    compiler it is widened in PyTorch every call: correct, but slow."""

    def __init__(self, groups: Int4Groups) -> None:
        rows, cols = groups.shape
        self.shape = (rows, cols)
        self.group_size = groups.group_size
        self.bits = groups.bits
        self.tiles = tile_codes(groups.codes & 15)
        self.high_bits = tile_fifth_bits(groups.codes) if groups.bits == 5 else torch.empty(0, dtype=torch.uint8)
        self.scales = tile_groups(groups.scales)
        # (code - 8) * scale + zero = code * scale + (zero - 8 * scale)
        self.mins = tile_groups(groups.zeros - 8 * groups.scales)
        self.exact_activations = True  # False: 8-bit activations into the dot products (set_activation_bits)

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes + self.high_bits.nbytes + self.scales.nbytes + self.mins.nbytes

    def step_nbytes(self, greedy: bool) -> int:  # read whole, greedy or not
        return self.nbytes

    def codes(self) -> torch.Tensor:
        """The [N, K] codes, 0..15 (0..31 with 5 bits)."""
        low = untile_codes(self.tiles, *self.shape)
        return low | untile_fifth_bits(self.high_bits, *self.shape) if self.bits == 5 else low

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = self.shape
        kernel = ops.load("int8_dot")
        if kernel is not None and self.tiles.device.type == "cpu":
            return kernel.int4_dequantize(self.tiles, self.high_bits, self.scales, self.mins, self.group_size, rows,
                                          cols, dtype)  # fmt: skip
        codes = self.codes().reshape(rows, cols // self.group_size, self.group_size).float()
        scales = untile_groups(self.scales, rows).float().unsqueeze(-1)
        mins = untile_groups(self.mins, rows).float().unsqueeze(-1)
        return torch.addcmul(mins, codes, scales).reshape(rows, cols).to(dtype)

    def load_kernels(self) -> None:
        if self.tiles.device.type == "cpu":
            ops.load("int8_dot")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> x @ W.T + bias in x's dtype."""
        kernel = ops.load("int8_dot")
        if kernel is None or x.shape[0] > dot_max_rows(x.dtype) or x.device.type != "cpu":
            return F.linear(x, self.dequantize(x.dtype), bias)
        out = kernel.int4_linear(x.contiguous(), self.tiles, self.high_bits, self.scales, self.mins, self.group_size,
                                 self.shape[0], self.exact_activations)  # fmt: skip
        return out if bias is None else out + bias
