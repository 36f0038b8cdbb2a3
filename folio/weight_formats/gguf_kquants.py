"""K-quant super-blocks (Q4_K, Q5_K, Q6_K) unpacked into affine groups of codes.

A k-quant super-block holds 256 values: one f16 super-scale (and super-min) plus small integer scales
per sub-block of 32 (Q4_K, Q5_K) or 16 (Q6_K) values. Multiplying the two out gives every sub-block
an ordinary float32 scale and bias, so k-quants share the (codes, scales, biases) form of the legacy
formats. Each such product, and each scale * code, fits in float32's 24-bit mantissa, so these
values are exact and dequantizing from them matches ggml bit for bit.

Byte layouts follow ggml's block_q4_K / block_q5_K / block_q6_K (ggml-common.h).
"""

from __future__ import annotations

import torch

# (codes [n_groups, group_size], scales [n_groups, 1] float32, biases [n_groups, 1] float32 or None)
Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

QK_K = 256


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte `offset` of every block, as a float32 column [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def bit_planes(packed: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """(packed[..., None, :] >> s) & mask for each s in `shifts`, stacked on a new second-last axis."""
    shift = torch.tensor(list(shifts), dtype=torch.uint8, device=packed.device).view(-1, 1)
    return (packed.unsqueeze(-2) >> shift) & mask


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
    group_scales = (f16_field(blocks, 0) * scales).reshape(-1, 1)
    group_biases = (f16_field(blocks, 2) * mins).neg_().reshape(-1, 1)
    # Each 32-byte chunk of qs holds two sub-blocks: low nibbles first, then high nibbles.
    low = bit_planes(qs.reshape(n, 4, 32), range(0, 8, 4), 15)  # [n, 4, 2, 32]
    return low.reshape(n * 8, 32), group_scales, group_biases


def unpack_q4_k(blocks: torch.Tensor) -> Unpacked:
    """Q4_K (144 bytes): d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.

    value = d*scale_j * q - dmin*min_j, q in [0, 15], groups of 32.
    """
    return _k4_groups(blocks, blocks[:, 16:144])


def unpack_q5_k(blocks: torch.Tensor) -> Unpacked:
    """Q5_K (176 bytes): as Q4_K plus 32 bytes whose bit j is the fifth bit of sub-block j's codes."""
    n = blocks.shape[0]
    low, scales, biases = _k4_groups(blocks, blocks[:, 48:176])
    high = bit_planes(blocks[:, 16:48], range(8), 1)  # [n, 8, 32]
    return low | (high.reshape(n * 8, 32) << 4), scales, biases


def unpack_q6_k(blocks: torch.Tensor) -> Unpacked:
    """Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d (f16).

    value = d*scale_j * (q - 32), q in [0, 63], groups of 16.
    """
    n = blocks.shape[0]
    # Each half (128 values) uses 64 bytes of ql (low nibbles, then high nibbles) and 32 bytes of qh
    # (four 2-bit planes, one per 32 values).
    low = bit_planes(blocks[:, :128].reshape(n, 2, 64), range(0, 8, 4), 15).reshape(n, 8, 32)
    high = bit_planes(blocks[:, 128:192].reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 8, 32)
    codes = (low | (high << 4)).view(torch.int8) - 32
    scales = f16_field(blocks, 208) * blocks[:, 192:208].view(torch.int8)
    return codes.reshape(n * 16, 16), scales.reshape(-1, 1), None
