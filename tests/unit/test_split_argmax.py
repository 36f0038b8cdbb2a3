"""A split vocabulary's argmax: each rank's best over its rows, merged, equals the argmax over the
whole row, ties included, and a row with a non-finite logit on any rank is reported. The fused row max
(folio/csrc/row_argmax.h) gives what torch.max gives, across its chunks of a long row too."""

from __future__ import annotations

import math

import pytest
import torch

from folio import ops
from folio.layers.split_argmax import local_best, pick_best, row_max

CHUNK = 1 << 15  # row_argmax.h: a long row is split over the threads in chunks of this many values


def _merged(logits: torch.Tensor, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_rank = -(-logits.shape[1] // ranks)  # ceil(V / ranks) rows each, the last rank fewer
    parts = [local_best(logits[:, r * per_rank : (r + 1) * per_rank], r * per_rank) for r in range(ranks)]
    return pick_best(torch.stack(parts, dim=1))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_merged_argmax_equals_the_whole_rows(ranks):
    logits = torch.randn(9, 10, generator=torch.Generator().manual_seed(ranks))
    logits[1, [2, 7]] = 5.0  # a tie across ranks: the first index wins
    logits[2, [3, 4]] = 6.0  # a tie inside one rank (or across, as the split falls)
    logits[3] = 1.0  # every token tied
    logits[4, :] = -math.inf
    logits[4, 9] = 0.0  # the best is the last rank's last row
    tokens, finite = _merged(logits, ranks)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert finite.tolist() == [row != 4 for row in range(9)]  # -inf is not finite


def test_non_finite_rows_are_reported_from_any_rank():
    logits = torch.zeros(3, 8)
    logits[0, 7] = math.nan  # on the last rank, not where the best is
    logits[1, 0] = math.inf
    tokens, finite = _merged(logits, 2)
    assert finite.tolist() == [False, False, True]
    assert tokens[2] == 0


@pytest.mark.parametrize("width", [1, 17, 1000, 2 * CHUNK + 5])
def test_the_fused_row_max_equals_torch_max(width):
    assert ops.load("fused_ops") is not None, "the fused ops must build: a C++ compiler is part of the setup"
    rows = torch.randn(8, width, generator=torch.Generator().manual_seed(width))
    rows[1] = 2.0  # every value tied: the first
    rows[2] = -math.inf
    last = width - 1
    rows[3, [last // 2, last]] = 9.0  # a tie, across chunks when the row is long
    rows[4, last] = math.inf
    rows[5, [last, last // 3]] = math.nan  # a NaN: NaN at the first one, as torch.max gives it
    rows[6, min(CHUNK, last)] = 7.0  # the best at a chunk's first value
    for values in (rows, rows[:, : max(1, width // 2)]):  # contiguous rows, and rows of a wider tensor
        best, index = row_max(values)
        want_best, want_index = values.max(dim=-1)
        assert torch.equal(index, want_index)
        torch.testing.assert_close(best, want_best, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("width", [1, 17, 1000, 2 * CHUNK + 5])
def test_the_fused_row_best_equals_its_tensor_ops(width):
    """local_best's triple from one kernel pass (row_best) against torch's max and isfinite: infinities and NaNs
    in any chunk, before or after the row's maximum."""
    kernel = ops.load("fused_ops")
    assert kernel is not None, "the fused ops must build: a C++ compiler is part of the setup"
    rows = torch.randn(8, width, generator=torch.Generator().manual_seed(width + 1))
    last = width - 1
    rows[0, last] = math.inf  # the maximum, and not finite
    rows[1, 0] = -math.inf  # not finite, not the maximum
    rows[2, last // 2] = math.nan
    rows[3, [0, last]] = -math.inf
    rows[4, min(CHUNK + 1, last)] = 50.0  # a finite maximum in the second chunk
    rows[5] = -math.inf
    for values in (rows, rows[:, : max(1, width // 2)]):
        got = kernel.row_best(values.contiguous(), 100)
        best, index = values.max(dim=-1)
        want = torch.stack([best.double(), (index + 100).double(), (~torch.isfinite(values).all(dim=-1)).double()], -1)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
