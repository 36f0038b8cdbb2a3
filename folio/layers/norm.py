"""RMSNorm (Gemma's variant scales by (1 + weight) instead of weight), and LayerNorm (GPT-2, BLOOM).

On CPU the fused op (fused_ops.py) computes it, with the residual add before it when one is given;
`reference` is the PyTorch definition, which the fused op is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from folio.layers.fused_ops import fused_ops_for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        init = 0.0 if weight_offset else 1.0
        self.weight = nn.Parameter(torch.full((dim,), init), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x)
        if ops is None:
            return self.reference(x)
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, self.weight_offset).view(x.shape)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). On CPU the sum is written into `residual` in place."""
        ops = fused_ops_for(x)
        if ops is None or x.dim() != 2 or not residual.is_contiguous():
            residual = residual + x
            return self.reference(residual), residual
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            # Gemma multiplies in float32 before casting back.
            return (x32 * (self.weight.float() + self.weight_offset)).to(dtype)
        return self.weight * x32.to(dtype)


class LayerNorm(nn.Module):
    """(x - mean) / std * weight + bias over the last dimension, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps)
        return normed.to(x.dtype)
