"""ALiBi (Press et al., used by BLOOM and MPT): no position embedding; each head adds
slope * (key position - query position) to its attention scores, so distant keys weigh less.

The slopes are a geometric sequence per head, as the reference implementations compute them (for a
head count that is not a power of two, the odd powers of the next power's base are appended).
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32 slopes."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base**power for power in range(1, closest + 1)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        slopes += [extra_base**power for power in range(1, 2 * remaining, 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(allowed: torch.Tensor, query_positions: torch.Tensor, slopes: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Additive attention bias [b, H, q, keys] for SDPA: slope * (key - query) where `allowed`
    ([b, 1, q, keys] bool) permits, -inf elsewhere. Key index k of the grid is position k."""
    keys = torch.arange(allowed.shape[-1], device=allowed.device)
    offset = (keys - query_positions.unsqueeze(-1)).unsqueeze(1)  # [b, 1, q, keys]
    bias = slopes.view(1, -1, 1, 1).to(allowed.device) * offset
    return bias.masked_fill(~allowed, float("-inf")).to(dtype)
