"""Round-to-nearest integer quantization in groups along K, with integer zero points: the quantizer
GPTQ and AWQ checkpoints assume (W = (q - z) * s), shared by `folio quantize`'s int8, int4, GPTQ and
AWQ methods.

As AutoGPTQ's quantizer does, a group's range always includes 0 (so 0 is exact), and a symmetric
group puts its zero point in the middle of the code range (2^(bits-1)).
"""

from __future__ import annotations

import torch

from folio.weight_formats.checkpoint_layouts import IntGroups, contiguous_group_index


def group_params(x: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, integer zero point) per row of x [N, group], as float32 [N]."""
    max_code = 2**bits - 1
    low = x.min(dim=1).values.clamp(max=0)
    high = x.max(dim=1).values.clamp(min=0)
    if symmetric:
        high = torch.maximum(low.abs(), high)
        low = -high
    scale = ((high - low) / max_code).clamp_min(1e-10)
    zero = torch.full_like(scale, 2 ** (bits - 1)) if symmetric else (-low / scale).round().clamp(0, max_code)
    return scale, zero


def quantize_column(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of x [N] or [N, m] given per-row scale and zero."""
    if x.dim() == 2:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return (x / scale).round().add(zero).clamp(0, 2**bits - 1)


def resolve_group_size(group_size: int, cols: int) -> int:
    """-1 means one group per row."""
    size = cols if group_size == -1 else group_size
    if cols % size:
        raise ValueError(f"input dimension {cols} is not a multiple of the group size {size}")
    return size


def rtn_int_groups(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = False) -> IntGroups:
    """Round-to-nearest: every group quantized on its own range."""
    rows, cols = weight.shape
    size = resolve_group_size(group_size, cols)
    grouped = weight.float().reshape(rows * (cols // size), size)
    scale, zero = group_params(grouped, bits, symmetric)
    codes = quantize_column(grouped, scale, zero, bits)
    return IntGroups(
        codes.reshape(rows, cols).to(torch.uint8),
        zero.reshape(rows, -1).to(torch.uint8),
        scale.reshape(rows, -1),
        bits,
        contiguous_group_index(cols, size),
    )
