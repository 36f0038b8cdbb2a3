"""Exp(1) noise for the exponential race both samplers draw with: argmax(p / E), E ~ Exp(1) per token,
picks token i with probability p_i.

E = -log(U) with U uniform in [0, 1): U = 0 gives E = inf, which no token wins with, so a token of
probability 0 can never be drawn (0 / 0 would be NaN, which argmax takes). One row per generator, so a
seeded request draws the same tokens whatever shares its batch. torch's `exponential_` on CPU cost ~5x
as much (347 ms against 63 for 64 rows of a 262,144-token vocabulary, one generator a row); the
logarithm then runs over the whole batch at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def exponential_rows(columns: int, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """[len(generators), columns] float32 Exp(1) noise, row i from generators[i] (None: torch's default)."""
    noise = torch.empty(len(generators), columns, dtype=torch.float32)
    for row, generator in enumerate(generators):
        torch.rand(columns, generator=generator, out=noise[row])
    return noise.log_().neg_()
