"""RMSNorm; Gemma's variant scales by (1 + weight) instead of weight."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        init = 0.0 if weight_offset else 1.0
        self.weight = nn.Parameter(torch.full((dim,), init), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            # Gemma multiplies in float32 before casting back.
            return (x32 * (self.weight.float() + self.weight_offset)).to(dtype)
        return self.weight * x32.to(dtype)
