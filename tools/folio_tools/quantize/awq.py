"""AWQ (Lin et al., 2023): activation-aware weight quantization.

A few input channels carry much larger activations than the rest, and the weights that multiply them
matter most. AWQ scales each input channel k of a weight up by s_k before round-to-nearest
quantization (so its weights get relatively finer steps) and divides the layer's input by s_k, which
is folded into the operation that produces the input (an RMSNorm's weight, or the rows of the
up-projection for the down-projection), so the checkpoint needs no extra tensors.

The scales are searched per layer as in the paper: s = mean|x|^alpha for alpha on a grid in [0, 1),
normalized around 1, keeping the alpha whose quantized layer reproduces the float layer's output on
calibration inputs best. That output error is measured through the inputs' second moment H = X^T X:
||X (W - W_q)^T||^2 = sum over rows of dW H dW^T, so the search needs no stored activations.
AutoAWQ's additional weight-clipping search is not done.
"""

from __future__ import annotations

import torch

from folio_tools.quantize.group_quantizer import rtn_int_groups

GRID = 20


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """||X (W - approx)^T||^2 for inputs with X^T X = hessian."""
    delta = (approx - weight).double()
    return float(((delta @ hessian.double()) * delta).sum())


def search_scales(
    weight: torch.Tensor, hessian: torch.Tensor, mean_abs: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """The per-input-channel scales s [K] (all ones if no alpha beats plain round-to-nearest)."""
    w = weight.float()
    best_error = output_error(w, rtn_int_groups(w, bits, group_size).dequantize(), hessian)
    best = torch.ones(w.shape[1])
    activation = mean_abs.float().clamp_min(1e-8)
    for step in range(1, GRID):
        scales = activation.pow(step / GRID).clamp_min(1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        approx = rtn_int_groups(w * scales, bits, group_size).dequantize() / scales
        error = output_error(w, approx, hessian)
        if error < best_error:
            best_error, best = error, scales
    return best
