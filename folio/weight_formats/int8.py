"""8-bit weights in groups along K: GGUF's symmetric formats of 5 to 8 bits (Q8_0 and Q5_0 in groups of
32, Q6_K in groups of 16), whose codes fit int8 as they are, and 8-bit GPTQ. That is what the model
keeps instead of a 2- or 4-byte dense weight. (Q5_0 projections are held tighter, as 5-bit tiles,
int4.py; a Q5_0 embedding comes here, where lookups read its rows.)

W[n, k] = scales[n, k // group] * codes[n, k]. `Int8Groups` is the form a loader produces (row-major
codes, float32 scales: rows can be split and joined). On CPU a layer then holds it as `PackedInt8`:
a byte per weight tiled by 16 rows for the int8 dot-product kernel (int8_dot.py), scales float16
where that is exact (Q8_0's and Q5_0's are: 1.0625 bytes per weight against the files' 1.0625 and
0.6875), else float32 (Q6_K: 1.125 against 0.82); past `dot_max_rows` rows it is widened in C++ for
one GEMM. Groups the kernel does not take stay `Int8Groups`, multiplied by the float kernel here for few
rows or dequantized for one GEMM. Embedding lookups dequantize only the rows asked for.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from folio import ops
from folio.weight_formats.gguf_dequant import GroupQuant
from folio.weight_formats.int8_dot import (
    ACTIVATION_BLOCK,
    INT8_GROUP_SIZES,
    TILE_ROWS,
    tile_groups,
    tile_int8_codes,
    untile_int8_codes,
)

logger = logging.getLogger("folio")

# Rows up to which the float kernel beats dequantize-then-GEMM. Measured on the project's machine for the
# 49152x576 LM head of smollm2 (2 threads): kernel 3.5 / 54 / 104 ms at 1 / 64 / 128 rows, against
# 94 / 121 / 118 ms (fp32 dequantize + GEMM; the widened copy alone is 113 MB).
KERNEL_MAX_ROWS = 128
# Rows of bfloat16 activations up to which the tiled dot-product kernel beats widening the weight for
# one GEMM (3072x576 and 4096x640, 2 threads: 311 / 320 against 307 / 307 GFLOP/s at 128 rows, 309 /
# 317 against 356 / 360 at 256); float32 activations take it at every row count, as 4-bit weights do
# (int4.dot_max_rows).
DOT_MAX_ROWS_BF16 = 128
# Activation rows from which `PackedInt8.greedy` picks from the 8-bit product: one row streams the weight
# from memory either way, and the residuals' products cost it nothing measurable. With six-bit tiles
# (`PackedInt8.prepare_greedy`) the first pass reads 3/4 of the codes, which pays from one row.
GREEDY_MIN_ROWS = 2
# The six high bits stand in for a head's codes in the greedy pick's first pass where they are within
# this much of each row (median of ||W - W~|| / ||W~||): ~2.5% on Q8_0 heads, whose codes span 8 bits.
# Codes of 5 or 6 bits (Q5_0, Q6_K) keep 3 or 4 bits there, and their bound would keep most tiles.
SIX_BIT_MAX_ERROR = 0.05
_NO_SIX_BIT = torch.empty(0, dtype=torch.uint8)  # int8_greedy's argument where a head has no copy


def dot_max_rows(dtype: torch.dtype) -> int:
    """The most activation rows of `dtype` the dot-product kernel is picked for."""
    return sys.maxsize if dtype == torch.float32 else DOT_MAX_ROWS_BF16


@dataclass
class Int8Groups:
    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / group] float32

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def step_nbytes(self, greedy: bool) -> int:  # read whole, greedy or not
        return self.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.shape
        grouped = self.codes.view(rows, -1, self.group_size).to(torch.float32) * self.scales.unsqueeze(-1)
        return grouped.view(rows, cols).to(dtype)

    @classmethod
    def cat_rows(cls, parts: list[Int8Groups]) -> Int8Groups:
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    def rows(self, index: torch.Tensor) -> Int8Groups:
        """The same weight with its output rows reordered (e.g. undoing llama.cpp's q/k permutation)."""
        return Int8Groups(self.codes[index], self.scales[index])

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized."""
        return self.rows(ids.flatten()).dequantize(dtype).view(*ids.shape, self.shape[1])

    def load_kernels(self) -> None:
        if self.codes.device.type == "cpu":
            ops.load("q8_linear")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> x @ W.T (+ bias) in x's dtype."""
        flat = x.reshape(-1, self.shape[1])
        rows, on_cpu = flat.shape[0], flat.device.type == "cpu"
        kernel = ops.load("q8_linear") if on_cpu and rows <= KERNEL_MAX_ROWS else None
        if kernel is not None:
            out = kernel.q8_linear(flat.float().contiguous(), self.codes, self.scales, self.group_size).to(x.dtype)
        else:
            out = F.linear(flat, self.dequantize(x.dtype))
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.shape[0])


class PackedInt8:
    """A [N, K] weight held as a byte per value, tiled by 16 rows for the int8 dot-product kernel
    (`int8_dot.tile_int8_codes`), with its scales per group tiled alongside (`tile_groups`). Multiplied
    by that kernel up to `dot_max_rows` rows; past them, or without a compiler, widened for one GEMM."""

    def __init__(self, groups: Int8Groups) -> None:
        self.shape = groups.shape
        self.group_size = groups.group_size
        self.tiles = tile_int8_codes(groups.codes)
        scales = groups.scales.float()
        exact = bool(torch.equal(scales.half().float(), scales))  # GGUF's Q8_0 and Q5_0 store float16 scales
        self.scales = tile_groups(scales, torch.float16 if exact else torch.float32)
        self.exact_activations = True  # False: 8-bit activations into the dot products (set_activation_bits)
        self._row_norms: torch.Tensor | None = None  # greedy(): each row's Euclidean norm, made on first use
        self._six_bit: torch.Tensor | None = None  # greedy()'s first pass, where prepare_greedy made its tiles

    @property
    def nbytes(self) -> int:
        extra = self._six_bit.nbytes if self._six_bit is not None else 0
        return self.tiles.nbytes + self.scales.nbytes + extra

    def step_nbytes(self, greedy: bool) -> int:
        """A greedy step's first pass reads the six-bit copy where there is one, not the 8-bit tiles (the
        second pass's few tiles aside); a sampled step reads the tiles, and so does a weight without it."""
        codes = self._six_bit if greedy and self._six_bit is not None else self.tiles
        return codes.nbytes + self.scales.nbytes

    def codes(self) -> torch.Tensor:
        """The [N, K] int8 codes."""
        return untile_int8_codes(self.tiles, self.shape[0], self.shape[1])

    def _row_scales(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, G] (or [len(rows), G]) float32 scales."""
        if rows is None:
            return self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[: self.shape[0]].float()
        return self.scales[rows // TILE_ROWS, :, rows % TILE_ROWS].float()

    def _widen(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        grouped = codes.view(codes.shape[0], -1, self.group_size).float() * scales.unsqueeze(-1)
        return grouped.view(codes.shape[0], -1).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        kernel = ops.load("int8_dot") if self.tiles.device.type == "cpu" else None
        if kernel is not None:
            return kernel.int8_dequantize(self.tiles, self.scales, self.group_size, *self.shape, dtype)
        return self._widen(self.codes(), self._row_scales(), dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized."""
        kernel = ops.load("int8_dot") if self.tiles.device.type == "cpu" else None
        if kernel is not None:  # one call: the indexing below is ~15 small ops, ~0.3 ms a decode step
            rows = kernel.int8_embedding(self.tiles, self.scales, self.group_size, *self.shape, ids, dtype)
            return rows.view(*ids.shape, self.shape[1])
        flat = ids.flatten()
        codes = untile_int8_codes(self.tiles, flat, self.shape[1])
        return self._widen(codes, self._row_scales(flat), dtype).view(*ids.shape, self.shape[1])

    def load_kernels(self) -> None:
        if self.tiles.device.type == "cpu":
            ops.load("int8_dot")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> x @ W.T (+ bias) in x's dtype."""
        flat = x.reshape(-1, self.shape[1])
        takes = flat.dtype in (torch.float32, torch.bfloat16) and flat.shape[0] <= dot_max_rows(flat.dtype)
        kernel = ops.load("int8_dot") if takes and flat.device.type == "cpu" else None
        if kernel is not None:
            out = kernel.int8_linear(
                flat.contiguous(), self.tiles, self.scales, self.group_size, self.shape[0], self.exact_activations
            )
        else:
            out = F.linear(flat, self.dequantize(x.dtype))
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.shape[0])

    def linear_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> x @ W.T written into `out` (float32 [M, N]) where the kernel takes x, else a
        new tensor as `linear` gives."""
        kernel = ops.load("int8_dot") if x.device.type == "cpu" else None
        if kernel is None or x.dtype != torch.float32 or x.shape[0] > dot_max_rows(x.dtype):
            return self.linear(x)
        return kernel.int8_linear_into(
            x.contiguous(), self.tiles, self.scales, self.group_size, self.shape[0], self.exact_activations, out
        )

    def row_norms(self, kernel: ModuleType) -> torch.Tensor:
        """[N] float32: each row's Euclidean norm, rounded up by 0.01% (the greedy bound needs an upper
        bound; float32 sums of 2^k squares err by under k x 2^-24). Made once, widened 64 MB at a time."""
        if self._row_norms is None:
            rows, cols = self.shape
            norms = torch.empty(rows, dtype=torch.float32)
            per_slice = max(1, (16 << 20) // (TILE_ROWS * cols))  # tiles: 64 MB of float32 at a time
            for tile in range(0, self.tiles.shape[0], per_slice):
                first, end = tile * TILE_ROWS, min(rows, (tile + per_slice) * TILE_ROWS)
                tiles, scales = self.tiles[tile : tile + per_slice], self.scales[tile : tile + per_slice]
                widened = kernel.int8_dequantize(tiles, scales, self.group_size, end - first, cols, torch.float32)
                norms[first:end] = torch.linalg.vector_norm(widened, dim=1)
            self._row_norms = norms * (1 + 1e-4)
        return self._row_norms

    def prepare_greedy(self) -> None:
        """Make what `greedy` reads (the row norms: ~0.3 s for a 262,144-row head) now, not in a request,
        and the six-bit tiles of its first pass where they stand close enough to the codes (0.75 bytes a
        weight more: the first pass then reads them instead of the 8-bit tiles)."""
        kernel = ops.load("int8_dot") if self.tiles.device.type == "cpu" else None
        if kernel is None:
            return
        norms = self.row_norms(kernel)
        if self._six_bit is None and self.group_size % ACTIVATION_BLOCK == 0 and self.exact_activations:
            six, approx_norms, residual_norms = kernel.int8_six_bit_tiles(
                self.tiles, self.scales, self.group_size, self.shape[0]
            )
            if float((residual_norms / approx_norms.clamp_min(1e-30)).median()) <= SIX_BIT_MAX_ERROR:
                self._six_bit = six
                logger.info("greedy pick: the LM head's six-bit codes for its first pass, %.1f MiB", six.nbytes / 2**20)
                self._row_norms = torch.maximum(norms, approx_norms)  # the bound's norms cover W~ too

    def greedy(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's argmax of `linear(x)` (float32 or bfloat16 x, the values in x's dtype as `linear`
        gives them), from the 8-bit product and the few tiles the bound keeps near its top (int8_greedy.h):
        (best float64 [M, 3]: maximum, first index, 0; decided [M] bool, false where only the full product
        can tell). None where `linear` would not take the kernel, below GREEDY_MIN_ROWS rows (one with the
        six-bit tiles), or where the weight multiplies 8-bit activations already."""
        kernel = ops.load("int8_dot") if x.device.type == "cpu" else None
        rows, six = x.shape[0], self._six_bit
        fewest = 1 if six is not None else GREEDY_MIN_ROWS
        takes = x.dtype in (torch.float32, torch.bfloat16) and fewest <= rows <= dot_max_rows(x.dtype)
        if kernel is None or not takes or not self.exact_activations:
            return None
        best, decided = kernel.int8_greedy(
            x.contiguous(), self.tiles, self.scales, self.group_size, self.shape[0], self.row_norms(kernel),
            six if six is not None else _NO_SIX_BIT,
        )  # fmt: skip
        return best, decided


def packed_for_kernel(groups: Int8Groups) -> PackedInt8 | Int8Groups:
    """The groups as the tiled kernel holds them, where it takes them: on CPU, K a multiple of 32, groups of
    16, 32 or a multiple of 64."""
    on_cpu, cols = groups.codes.device.type == "cpu", groups.shape[1]
    takes = on_cpu and cols % ACTIVATION_BLOCK == 0 and groups.group_size in INT8_GROUP_SIZES
    return PackedInt8(groups) if takes else groups


def int8_groups(quant: GroupQuant, shape: tuple[int, ...]) -> Int8Groups | None:
    """A GGUF tensor's groups as Int8Groups (a symmetric format: signed codes, no bias; Q8_0, Q6_K,
    Q5_0, also Q4_0 if asked), else None."""
    if quant.biases is not None or quant.codes.dtype != torch.int8 or len(shape) != 2:
        return None
    rows, cols = shape
    return Int8Groups(quant.codes.reshape(rows, cols).clone(), quant.scales.reshape(rows, -1).clone())


# PyTorch's per-channel int8 kernel beats dequantize-then-GEMM up to about this many rows (a 1536x576
# layer, bf16, 2 threads: 0.92 vs 1.06 ms at 64 rows, 3.4 vs 1.4 ms at 256).
CHANNEL_KERNEL_MAX_ROWS = 64


class ChannelInt8:
    """int8 per output channel, symmetric (W = codes * scales[n]), multiplied by
    `aten._weight_int8pack_mm` with bf16 activations (its fp32 path is ~13x slower). Made on the fly
    from a dense weight (`quantize`) or loaded from a checkpoint's codes and scales."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.codes = codes.to(torch.int8).contiguous()  # [N, K]
        self.scales = scales.reshape(-1).to(torch.bfloat16)  # [N]
        self.shape = (codes.shape[0], codes.shape[1])

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> ChannelInt8:
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-8)
        return cls((w / scales.unsqueeze(1)).round().clamp(-127, 127), scales)

    @classmethod
    def cat_rows(cls, parts: list[ChannelInt8]) -> ChannelInt8:
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def step_nbytes(self, greedy: bool) -> int:  # read whole, greedy or not
        return self.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scales.float().unsqueeze(1)).to(dtype)

    def load_kernels(self) -> None:
        """None to load: aten's own int8 kernel."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> x @ W.T + bias in x's dtype."""
        if x.shape[0] > CHANNEL_KERNEL_MAX_ROWS or x.device.type != "cpu":
            return F.linear(x, self.dequantize(x.dtype), bias)
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.codes, self.scales)
        out = out.to(x.dtype)
        return out if bias is None else out + bias
