"""4-bit weights in groups along K, kept packed in memory and multiplied by PyTorch's CPU int4 kernel.

`Int4Groups` is the unpacked form a loader produces: w[n, k] = (codes[n, k] - 8) * scales[n, g] +
zeros[n, g], with g = k // group_size (32, 64, 128 or 256: the kernel's group sizes). GGUF's Q4_0,
Q4_1 and Q4_K (groups of 32) and GPTQ/AWQ checkpoints without act-order map onto it exactly (the int4
kernel's own convention), so 4-bit tensors load without ever being widened to 16/32 bits.

`PackedInt4` holds the codes in the layout of `aten._convert_weight_to_int4pack_for_cpu` (half a
byte per weight) plus bfloat16 scales and zeros, and multiplies two ways: the int4 kernel
(`_weight_int4pack_mm_for_cpu`, which reads the weights once; best for up to a few hundred rows) or,
for more rows, dequantizing and one dense GEMM. The kernel's fast path takes bfloat16 activations
(its float32 path is ~10x slower than a dense float32 GEMV), so a float32 model's 4-bit layers cast
their input to bfloat16 and their output back: finer than llama.cpp, which quantizes activations to
8 bits for its 4-bit dot products. `LLM(quantization="none")` keeps everything in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from folio.quant.gguf_dequant import GroupQuant

GROUP_SIZE = 32  # GGUF's 4-bit formats, and the default of round-to-nearest
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
BLOCK_N = 64  # the CPU int4 layout packs rows in blocks of 64: rows n and n + 32 share a byte

KERNEL_DTYPE = torch.bfloat16
# Rows (tokens) up to which the int4 kernel beats dequantize-then-GEMM. On the project's machine
# (a 1536x576 layer, bf16, 2 threads) the kernel took 3.3 ms at 256 rows against 5.5 ms, and 6.8 ms
# at 512 against 4.7 ms; see docs/benchmarks.md.
KERNEL_MAX_ROWS = 384


@dataclass
class Int4Groups:
    codes: torch.Tensor  # [N, K] uint8, 0..15
    scales: torch.Tensor  # [N, K / 32] float32
    zeros: torch.Tensor  # [N, K / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @classmethod
    def cat_rows(cls, parts: list[Int4Groups]) -> Int4Groups:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))

    def rows(self, index: torch.Tensor) -> Int4Groups:
        """The same weight with its output rows reordered (e.g. undoing llama.cpp's q/k permutation)."""
        return Int4Groups(self.codes[index], self.scales[index], self.zeros[index])

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
    (more than 4 bits, groups other than 32) or its shape does not suit the kernel."""
    if quant.bits != 4 or quant.group_size != GROUP_SIZE or len(shape) != 2:
        return None
    rows, cols = shape
    if rows % BLOCK_N or cols % GROUP_SIZE:
        return None
    scales = quant.scales.view(rows, cols // GROUP_SIZE)
    if quant.codes.dtype == torch.int8:  # symmetric formats store code - 8
        codes = (quant.codes.to(torch.int16) + 8).to(torch.uint8)
        zeros = torch.zeros_like(scales)
    else:  # value = scale * code + bias = (code - 8) * scale + (bias + 8 * scale)
        codes = quant.codes
        zeros = scales * 8
    if quant.biases is not None:
        zeros = zeros + quant.biases.view(rows, cols // GROUP_SIZE)
    return Int4Groups(codes.reshape(rows, cols).contiguous(), scales.contiguous(), zeros.contiguous())


class PackedInt4:
    """A [N, K] weight packed for the CPU int4 kernel."""

    def __init__(self, groups: Int4Groups) -> None:
        rows, cols = groups.shape
        self.shape = (rows, cols)
        self.group_size = groups.group_size
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32), 1)
        # [K / group, N, 2]: the kernel's (scale, zero) per group and output row.
        self.scales_zeros = torch.stack([groups.scales.t(), groups.zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes

    def codes(self) -> torch.Tensor:
        """Unpack the kernel's layout back to [N, K] codes: byte (b, k, i) holds row 64b + i in its low
        nibble and row 64b + 32 + i in its high nibble."""
        rows, cols = self.shape
        blocks = self.packed.view(rows // BLOCK_N, cols, BLOCK_N // 2)
        both = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [N / 64, K, 64]
        return both.permute(0, 2, 1).reshape(rows, cols)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = self.shape
        codes = self.codes().reshape(rows, cols // self.group_size, self.group_size).to(dtype) - 8
        scales = self.scales_zeros[..., 0].t().unsqueeze(-1).to(dtype)  # [N, K / group, 1]
        zeros = self.scales_zeros[..., 1].t().unsqueeze(-1).to(dtype)
        return torch.addcmul(zeros, codes, scales).reshape(rows, cols)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> x @ W.T + bias in x's dtype: the int4 kernel up to KERNEL_MAX_ROWS rows, else
        dequantize-then-GEMM."""
        if x.shape[0] > KERNEL_MAX_ROWS:
            return F.linear(x, self.dequantize(x.dtype), bias)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(KERNEL_DTYPE).contiguous(), self.packed, self.group_size,
                                                          self.scales_zeros).to(x.dtype)  # fmt: skip
        return out if bias is None else out + bias
