"""Which rows of a [N, V] float tensor hold non-finite values, or no finite value at all, at the cost
of one reduction per row in the usual case.

An elementwise test over a large vocabulary is slow: on one thread `isfinite(x).all(-1)` took ~70 ms
for 64 rows of Gemma 3's 262,144 logits here, against ~2.5 ms for a row sum. A row's sum is finite
whenever all its terms are (and its max is finite only if some term is), so the elementwise test
runs only on the rows the reduction flags: the rare overflow of a finite sum is cleared exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def nonfinite_rows(values: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows with a NaN or an infinity."""
    return _screened(values, values.sum(dim=-1), lambda rows: ~torch.isfinite(rows).all(dim=-1))


def rows_without_finite(values: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows in which no value is finite (every token masked, say)."""
    return _screened(values, values.amax(dim=-1), lambda rows: ~torch.isfinite(rows).any(dim=-1))


def _screened(
    values: torch.Tensor, summary: torch.Tensor, exact: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    found = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    suspects = (~torch.isfinite(summary)).nonzero().flatten()
    if suspects.numel():
        found[suspects] = exact(values[suspects])
    return found
