"""NF4 weights: QLoRA's 4-bit NormalFloat with double-quantized block scales, ~4.13 bits per weight.

Each block of 64 weights along K (within a row) is divided by its absolute maximum and rounded to the
nearest of 16 values placed at quantiles of a standard normal (`NF4_CODEBOOK`, bitsandbytes' table),
which suits the bell-shaped weights of trained networks better than evenly spaced int4 levels.
Two codes share a byte, the even k in the high nibble as bitsandbytes packs them.

The float32 block absmax would cost 0.5 bit per weight, so it is quantized again (QLoRA's double
quantization): its mean is subtracted (`absmax_offset`), and each run of 256 values is stored as 8-bit
codes with one float32 scale. bitsandbytes uses its dynamic (exponent-based) 8-bit map there; folio
uses a plain linear one, absmax = (code - 128) * scale + offset with a symmetric scale per 256, so the
4-bit codes and codebook match bitsandbytes but the double-quant layout is folio's own (and not
byte-compatible with a bitsandbytes checkpoint's `absmax`/`nested_*` tensors).

For few rows a small C++ kernel decodes the codes (and the absmax) on the fly and never builds the
float weight; for many rows (or without a compiler, or off CPU) the weight is dequantized and one GEMM
runs. `to_tensors`/`from_tensors` give a flat dict of tensors to save with safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from folio import ops

# bitsandbytes' `get_4bit_type("nf4")`: the normal quantiles of QLoRA (arXiv 2305.14314), scaled to [-1, 1].
NF4_CODEBOOK = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float32)  # fmt: skip
BLOCK_SIZE = 64  # weights per absmax, along K within a row
SCALE_BLOCK_SIZE = 256  # absmax values per double-quantization scale
ZERO_CODE = 128  # the 8-bit absmax code of `absmax_offset`

# Rounding w / absmax to the nearest codebook value = bucketing it between consecutive midpoints.
_MIDPOINTS = (NF4_CODEBOOK[1:] + NF4_CODEBOOK[:-1]) / 2
# One byte -> its two weights (high nibble first), so dequantizing indexes once per byte.
_BYTE_PAIRS = torch.stack([NF4_CODEBOOK.repeat_interleave(16), NF4_CODEBOOK.repeat(16)], dim=1)  # [256, 2]
_QUANTIZE_CHUNK = 1 << 22  # weights rounded at a time (bounds the int64 indices' memory)

# Rows up to which the kernel beats dequantize-then-GEMM. Measured on the project's machine (2 threads,
# shared, so +-20%), kernel against dequantize + GEMM in ms for a 1536x576 / a 576x1536 weight:
#   float32 x:   1 row 0.29 vs 1.1 / 0.22 vs 0.76,   16: 0.55 vs 1.4 / 0.43 vs 1.1,   64: 1.4 vs 2.1 / 1.0 vs 1.5,
#              128: 2.5 vs 2.6 / 1.8 vs 2.1,  192: 2.8 vs 2.9 / 3.4 vs 2.7,  256: 4.7 vs 3.8 / 4.9 vs 3.2;
#   bfloat16 x:  1 row 0.27 vs 0.82 / 0.24 vs 0.96, 16: 0.47 vs 0.93 / 0.55 vs 1.0, 64: 1.0 vs 1.1 / 1.3 vs 1.2,
#              128: 2.3 vs 1.8 / 1.8 vs 1.5,  256: 3.2 vs 1.9 / 4.5 vs 2.0 (the bf16 GEMM is faster, the kernel not).
KERNEL_MAX_ROWS = 128  # float32 x
KERNEL_MAX_ROWS_16BIT = 64  # bfloat16 / float16 x


def _double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Block absmax [B] -> (uint8 codes [B], float32 scales [ceil(B / 256)], offset)."""
    offset = absmax.mean()
    centered = absmax - offset
    padded = F.pad(centered, (0, -centered.numel() % SCALE_BLOCK_SIZE)).view(-1, SCALE_BLOCK_SIZE)
    scales = padded.abs().amax(dim=1) / 127
    steps = (padded / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)).round().clamp(-127, 127)
    codes = (steps + ZERO_CODE).to(torch.uint8).flatten()[: absmax.numel()]
    return codes.contiguous(), scales.contiguous(), float(offset)


@dataclass
class NF4Weight:
    codes: torch.Tensor  # uint8 [N, K / 2]: weight k = 2j in the high nibble of byte j, k = 2j + 1 in the low
    absmax_codes: torch.Tensor  # uint8 [N * K / 64]: block absmax, double-quantized
    absmax_scales: torch.Tensor  # float32 [ceil(N * K / 64 / 256)]
    absmax_offset: float  # the mean block absmax, subtracted before the 8-bit quantization
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        blocks = rows * cols // BLOCK_SIZE
        if cols % BLOCK_SIZE:
            raise ValueError(f"NF4 needs K divisible by {BLOCK_SIZE}, got shape {self.shape}")
        if (
            self.codes.dtype != torch.uint8
            or tuple(self.codes.shape) != (rows, cols // 2)
            or self.absmax_codes.dtype != torch.uint8
            or self.absmax_codes.numel() != blocks
            or self.absmax_scales.dtype != torch.float32
            or self.absmax_scales.numel() != -(-blocks // SCALE_BLOCK_SIZE)
        ):
            raise ValueError(f"NF4 tensors do not match shape {self.shape}")

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> NF4Weight:
        """Round each weight / its block's absmax to the nearest codebook value (bitsandbytes' rule: the
        codes are chosen against the exact absmax, which is double-quantized afterwards)."""
        if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
            raise ValueError(f"NF4 needs a 2-D weight with K divisible by {BLOCK_SIZE}, got {tuple(weight.shape)}")
        rows, cols = weight.shape
        blocks = weight.detach().to(torch.float32).reshape(-1, BLOCK_SIZE)
        absmax = blocks.abs().amax(dim=1)
        codes = torch.empty(blocks.numel() // 2, dtype=torch.uint8, device=weight.device)
        midpoints = _MIDPOINTS.to(weight.device)
        step = _QUANTIZE_CHUNK // BLOCK_SIZE
        for start in range(0, blocks.shape[0], step):
            chunk = blocks[start : start + step]
            scaled = chunk / absmax[start : start + step].clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
            nearest = torch.bucketize(scaled, midpoints).to(torch.uint8).view(-1, 2)
            codes[start * BLOCK_SIZE // 2 : (start + chunk.shape[0]) * BLOCK_SIZE // 2] = (
                nearest[:, 0] << 4 | nearest[:, 1]
            )
        absmax_codes, absmax_scales, offset = _double_quantize(absmax)
        return cls(codes.view(rows, cols // 2), absmax_codes, absmax_scales, offset, (rows, cols))

    def block_absmax(self) -> torch.Tensor:
        """The decoded absmax of each block of 64, float32 [N * K / 64] (row-major blocks)."""
        scales = self.absmax_scales.repeat_interleave(SCALE_BLOCK_SIZE)[: self.absmax_codes.numel()]
        return (self.absmax_codes.to(torch.float32) - ZERO_CODE) * scales + self.absmax_offset

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.shape
        # index_select is ~3x faster than advanced indexing here (0.5 against 1.6 ms for 1536x576).
        pairs = _BYTE_PAIRS.to(self.codes.device).index_select(0, self.codes.flatten().long())
        values = pairs.view(-1, BLOCK_SIZE)
        return (values * self.block_absmax().unsqueeze(1)).view(rows, cols).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.absmax_codes.nbytes + self.absmax_scales.nbytes + 4  # + float32 offset

    def step_nbytes(self, greedy: bool) -> int:  # read whole, greedy or not
        return self.nbytes

    def load_kernels(self) -> None:
        if self.codes.device.type == "cpu":
            ops.load("nf4_linear")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> x @ W.T (+ bias) in x's dtype."""
        flat = x.reshape(-1, self.shape[1])
        kernel = ops.load("nf4_linear") if flat.device.type == "cpu" else None
        max_rows = KERNEL_MAX_ROWS if x.dtype == torch.float32 else KERNEL_MAX_ROWS_16BIT
        if kernel is None or flat.shape[0] > max_rows:
            out = F.linear(flat, self.dequantize(x.dtype))
        else:
            out = kernel.nf4_linear(flat.float().contiguous(), self.codes, self.absmax_codes, self.absmax_scales,
                                    self.absmax_offset, NF4_CODEBOOK).to(x.dtype)  # fmt: skip
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.shape[0])

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The weight as flat tensors, e.g. for `safetensors.torch.save_file`."""
        return {
            "weight_nf4": self.codes.contiguous(),
            "weight_absmax_codes": self.absmax_codes.contiguous(),
            "weight_absmax_scales": self.absmax_scales.contiguous(),
            "weight_absmax_offset": torch.tensor(self.absmax_offset, dtype=torch.float32),
            "weight_shape": torch.tensor(self.shape, dtype=torch.int64),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> NF4Weight:
        rows, cols = (int(v) for v in tensors["weight_shape"].tolist())
        return cls(
            tensors["weight_nf4"].contiguous(),
            tensors["weight_absmax_codes"].contiguous(),
            tensors["weight_absmax_scales"].to(torch.float32).contiguous(),
            float(tensors["weight_absmax_offset"].item()),
            (rows, cols),
        )
