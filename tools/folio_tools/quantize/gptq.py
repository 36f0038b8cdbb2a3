"""GPTQ (Frantar et al., 2022): quantize a layer's weight one input column at a time, and after each
column spread its rounding error over the columns not yet quantized, weighted by the inverse Hessian
of the layer's inputs (H = 2 X^T X over calibration tokens), so the layer's output on those inputs
moves as little as possible.

This follows the paper's blocked "lazy batch" form: columns are processed in blocks of 128, errors
inside a block are applied column by column, and the block's accumulated error updates the rest of
the matrix at once. Group parameters (scale, zero) are fixed when the first column of a group is
reached, from the group's columns as updated so far. Without act-order (columns in their natural
order), so the checkpoint's g_idx is plain k // group_size and loads into the int4 kernel as it is.
"""

from __future__ import annotations

import torch

from folio.weight_formats.checkpoint_layouts import IntGroups, contiguous_group_index
from folio_tools.quantize.group_quantizer import group_params, quantize_column, resolve_group_size

BLOCK = 128
DAMPING = 0.01  # fraction of the mean Hessian diagonal added to it, as in the reference implementation


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool = False,
    act_order: bool = True,
) -> IntGroups:
    """weight [N, K], hessian [K, K] (X^T X of the layer's inputs; its scale does not matter).

    `act_order` quantizes the columns with the largest inputs (largest Hessian diagonal) first, while
    the most columns remain to absorb their error. Groups stay the natural k // group_size, with their
    scale and zero fixed from the weight before any update ("static groups"), so the checkpoint needs
    no g_idx permutation and loads straight into the int4 kernel."""
    rows, cols = weight.shape
    size = resolve_group_size(group_size, cols)
    if BLOCK % size and size % BLOCK:
        raise ValueError(f"group size {size} must divide or be a multiple of {BLOCK}")
    w = weight.float().clone()
    h = hessian.double().clone()
    dead = torch.diag(h) == 0  # inputs never seen: their weights cannot matter, quantize them as 0
    h[dead, dead] = 1
    w[:, dead] = 0
    scales = torch.zeros(rows, cols // size)
    zeros = torch.zeros(rows, cols // size)
    order = torch.arange(cols)
    if act_order:
        static = group_params(w.reshape(rows * (cols // size), size), bits, symmetric)
        scales, zeros = (t.reshape(rows, cols // size) for t in static)
        order = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, order], h[order][:, order]
    h += DAMPING * torch.mean(torch.diag(h)) * torch.eye(cols, dtype=h.dtype)
    # Upper Cholesky factor of H^-1: row i holds how column i's error propagates to later columns.
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    groups = (order // size).tolist()
    for start in range(0, cols, BLOCK):
        end = min(start + BLOCK, cols)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        block_inv = h_inv[start:end, start:end]
        for i in range(end - start):
            position, group = start + i, groups[start + i]
            if not act_order and position % size == 0:
                # The group's columns as updated so far: those in this block from `block`, any later
                # (groups wider than a block) from `w`.
                current = torch.cat([block[:, i:], w[:, end : position + size]], dim=1)[:, :size]
                scales[:, group], zeros[:, group] = group_params(current, bits, symmetric)
            scale, zero = scales[:, group], zeros[:, group]
            q = quantize_column(block[:, i], scale, zero, bits)
            codes[:, position] = q.to(torch.uint8)
            error = (block[:, i] - (q - zero) * scale) / block_inv[i, i]
            block[:, i:] -= error.unsqueeze(1) * block_inv[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    codes[:, order] = codes.clone()  # back to the natural column order
    return IntGroups(codes, zeros.to(torch.uint8), scales.float(), bits, contiguous_group_index(cols, size))
