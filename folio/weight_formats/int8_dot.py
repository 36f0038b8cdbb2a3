"""The integer dot-product kernels (folio/csrc/int8_dot.cpp): activations quantized to int8 in blocks of 32,
multiplied with 4-bit or 8-bit weight codes by AVX-512 VNNI, as llama.cpp's CPU backend does; the
4-bit kernel also multiplies each activation's rounding error, coded in 8 more bits.

They read each weight byte once and do the block arithmetic in integers, so they set batch-1 decode
speed. Their cost grows with every activation row; with float32 activations they still beat any
float32 GEMM at every row count, with bfloat16 ones past a row count each caller measured
(int4.dot_max_rows, int8.dot_max_rows) the weight is widened for one bf16 GEMM instead. The integer part
is exact; what rounding costs is bounded in the tests.
"""

from __future__ import annotations

import torch

from folio import ops

ACTIVATION_BLOCK = 32
TILE_ROWS = 16  # weights are tiled by 16 rows: one vector lane per row
GROUP_SIZES = (32, 64, 128, 256)  # weight groups the 4-bit kernel takes: 32, or a multiple of 64
INT8_GROUP_SIZES = (16, *GROUP_SIZES)  # and the 8-bit one: also Q6_K's groups of 16


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> the kernel's tiles, uint8 [ceil(N / 16), K / 32 * 256]: rows in tiles of
    16 (the last padded with zeros), and per tile and block of 32 values, byte (j, i, t) holds value
    4j + t of row i in its low nibble and value 16 + 4j + t in its high one."""
    rows, cols = codes.shape
    padded = _pad_rows(codes.to(torch.uint8), TILE_ROWS)
    # [tile, i, block, half, j, t] with k = 32 * block + 16 * half + 4 * j + t
    parts = padded.view(-1, TILE_ROWS, cols // ACTIVATION_BLOCK, 2, 4, 4)
    nibbles = parts[:, :, :, 0] | (parts[:, :, :, 1] << 4)  # [tile, i, block, j, t]
    return _tiles_of_words(nibbles, padded.shape[0] // TILE_ROWS)


def untile_codes(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `tile_codes`: [N, K] codes."""
    nibbles = tiles.view(-1, cols // ACTIVATION_BLOCK, 4, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)  # [tile, i, b, j, t]
    both = torch.stack([nibbles & 15, nibbles >> 4], dim=3)  # [tile, i, block, half, j, t]
    return both.reshape(-1, cols)[:rows]


FIFTH_BIT_BLOCK_BYTES = 64  # a 5-bit tile's fifth bits per block of 32: eight 64-bit masks
# Times eight little-endian bytes of 0 or 1, moves byte k's bit to bit 56 + k: the eight land in the top
# byte, no two partial products meeting (8k - 7j differs for every pair), so nothing carries into it.
_GATHER_BYTE_BITS = 0x0102040810204080


def tile_fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..31 -> their fifth bits as the 5-bit kernel reads them beside `tile_codes(codes & 15)`:
    uint8 [ceil(N / 16), K / 32 * 64], per tile and block eight little-endian 64-bit masks, mask 2j + h
    holding in bit 4i + t the fifth bit of value 16h + 4j + t of row i (int8_tiles.h)."""
    rows, cols = codes.shape
    padded = _pad_rows((codes.to(torch.uint8) >> 4) & 1, TILE_ROWS)
    parts = padded.view(-1, TILE_ROWS, cols // ACTIVATION_BLOCK, 2, 4, 4)  # [tile, i, block, h, j, t]
    bits = parts.permute(0, 2, 4, 3, 1, 5).contiguous()  # [tile, block, j, h, (i, t)]: bytes of 8 bits
    packed = (((bits.view(-1, 8).view(torch.int64) * _GATHER_BYTE_BITS) >> 56) & 0xFF).to(torch.uint8)
    return packed.view(padded.shape[0] // TILE_ROWS, -1).contiguous()


def untile_fifth_bits(high_bits: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `tile_fifth_bits`: [N, K] uint8, 16 where a code's fifth bit is set, else 0."""
    bits = (high_bits.view(-1, 1).to(torch.int16) >> torch.arange(8, dtype=torch.int16)) & 1
    parts = bits.view(-1, cols // ACTIVATION_BLOCK, 4, 2, TILE_ROWS, 4)  # [tile, block, j, h, i, t]
    return (parts.permute(0, 4, 1, 3, 2, 5).reshape(-1, cols)[:rows] << 4).to(torch.uint8)


def tile_int8_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 codes -> the 8-bit kernel's tiles, uint8 [ceil(N / 16), K / 32 * 512]: rows in tiles of
    16 (the last padded with zeros), and per tile and block of 32 values, byte (j, i, t) holds value
    4j + t of row i, plus 128."""
    rows, cols = codes.shape
    shifted = codes.contiguous().view(torch.uint8) ^ 0x80  # + 128, modulo 256
    padded = _pad_rows(shifted, TILE_ROWS, fill=128)
    parts = padded.view(-1, TILE_ROWS, cols // ACTIVATION_BLOCK, 8, 4)  # [tile, i, block, j, t]
    return _tiles_of_words(parts, padded.shape[0] // TILE_ROWS)


def _tiles_of_words(parts: torch.Tensor, tiles: int) -> torch.Tensor:
    """[tile, i, block, j, t] bytes, t of 4 -> [tile, (block, j, i, t)]: the permutation moves each run of
    four bytes whole, as one int32 (a byte-wise permute of Gemma 3's 262k-row head takes 3x as long)."""
    words = parts.contiguous().view(torch.int32).view(parts.shape[:-1])  # [tile, i, block, j]
    return words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(tiles, -1)


def untile_int8_codes(tiles: torch.Tensor, rows: torch.Tensor | int, cols: int) -> torch.Tensor:
    """The inverse of `tile_int8_codes`: [N, K] int8 codes, of all rows (`rows` an int: how many) or of
    the rows an index tensor names (an embedding lookup)."""
    per_tile = tiles.view(tiles.shape[0], cols // ACTIVATION_BLOCK, 8, TILE_ROWS, 4)  # [tile, block, j, i, t]
    if isinstance(rows, int):
        picked = per_tile.permute(0, 3, 1, 2, 4).reshape(-1, cols)[:rows]
    else:
        picked = per_tile[rows // TILE_ROWS, :, :, rows % TILE_ROWS, :].reshape(-1, cols)  # [n, block, j, t]
    return (picked.to(torch.int16) - 128).to(torch.int8)


def tile_groups(values: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Per-group [N, G] scales or mins -> [ceil(N / 16), G, 16] in `dtype`, a tile's rows side by side."""
    padded = _pad_rows(values.to(dtype), TILE_ROWS)
    return padded.view(-1, TILE_ROWS, values.shape[1]).transpose(1, 2).contiguous()


def untile_groups(tiled: torch.Tensor, rows: int) -> torch.Tensor:
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1])[:rows]


def _pad_rows(t: torch.Tensor, multiple: int, fill: int = 0) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    return t if not extra else torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (int8 codes [M, K], float32 scales [M, K / 32], int8 residual codes [M, K])
    exactly as the kernels round them: x ~ scale * code, and for the 4-bit kernel x ~ scale * (code +
    residual / 256). For tests: the integer part of a product is then checked exactly."""
    kernel = ops.load("int8_dot")
    if kernel is None:
        raise RuntimeError("the int8 dot-product kernel could not be built")
    codes, scales, residuals = kernel.quantize_activations(x.float().contiguous())
    return codes, scales, residuals
