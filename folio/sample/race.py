"""Draws each row's token by an exponential race: argmax(p / E) with E ~ Exp(1) per token picks token i
with probability p_i. In logs that is argmax(scaled - log E), where the scaled logits are log p plus a
row constant, so no softmax is needed for the race itself.

Each row draws from its own generator, and as many values as the row itself decides, so a seeded
request gets the same tokens whatever shares its batch:
- a row whose top-k / top-p set is a prefix of its best tokens races among them only (40 values for
  top-k 40, not 262,144);
- a row whose nucleus is wider than its prefix races over the whole row, the rest masked (`race_dense`);
- a row that keeps every token first tosses a coin weighted by the mass of its best `HEAD` tokens, then
  races within the head or within the rest. That is the same distribution as one race over the whole
  row (a mixture of the two parts, each drawn in proportion), and the whole row's noise is drawn only
  when the tail wins the toss (the tails of a batch in one race).

The noise E = -log(U), U uniform in [0, 1): U = 0 gives E = inf, which no token wins with, so a token of
probability 0 can never be drawn (0 / 0 would be NaN, which argmax takes). Speculative decoding's
verification races with it too (p / E directly).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from folio.sample.top_k_top_p import KeptTokens

HEAD = 1024


def exponential_rows(columns: int, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """[len(generators), columns] float32 Exp(1) noise, row i from generators[i] (None: torch's default), so
    a seeded request draws the same tokens whatever shares its batch. torch's `exponential_` on CPU cost ~5x
    as much (347 ms against 63 for 64 rows of a 262,144-token vocabulary, one generator a row); the
    logarithm then runs over the whole batch at once."""
    noise = torch.empty(len(generators), columns, dtype=torch.float32)
    for row, generator in enumerate(generators):
        torch.rand(columns, generator=generator, out=noise[row])
    return noise.log_().neg_()


def race_kept(
    scaled: torch.Tensor, kept: KeptTokens, rows: Sequence[int], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """The token of each of `rows` (rows that filter, not wide ones), raced among the tokens it keeps only."""
    return [_race(scaled[row], kept.index[row, : int(kept.counts[row])], generators[row]) for row in rows]


def race_whole_rows(
    scaled: torch.Tensor, rows: Sequence[int], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """The token of each of `rows` (rows that keep every token): the head or the tail by a weighted coin,
    then a race within it."""
    if not rows:
        return []
    part = scaled if len(rows) == scaled.shape[0] else scaled[list(rows)]
    head_mass, head_index = part.softmax(dim=-1).topk(min(HEAD, part.shape[1]), dim=-1)
    if head_index.shape[1] == part.shape[1]:  # the head is the whole row
        return [_race(part[j], head_index[j], generators[row]) for j, row in enumerate(rows)]
    coins = [float(torch.rand(1, generator=generators[row], dtype=torch.float64)) for row in rows]
    head_masses = head_mass.sum(dim=-1, dtype=torch.float64).tolist()
    in_tail = [j for j in range(len(rows)) if coins[j] >= head_masses[j]]
    tail_tokens: dict[int, int] = {}
    if in_tail:  # one batched race over these rows with their heads masked out
        tails = part[in_tail].scatter_(1, head_index[in_tail], float("-inf"))
        won = race_dense(tails, [generators[rows[j]] for j in in_tail])
        finite = torch.isfinite(tails.gather(1, won.unsqueeze(1))).squeeze(1)
        # The head's mass rounds below 1 even when nothing is left past it (masks): then the head it is.
        tail_tokens = {j: int(token) for j, token, ok in zip(in_tail, won, finite.tolist(), strict=True) if ok}
    return [
        tail_tokens[j] if j in tail_tokens else _race(part[j], head_index[j], generators[row])
        for j, row in enumerate(rows)
    ]


def race_dense(scaled: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """scaled [M, V] (given up: changed in place) -> each row's token [M], raced over the whole row."""
    noise = exponential_rows(scaled.shape[1], generators)
    return scaled.sub_(noise.log_()).argmax(dim=-1)


def _race(scaled_row: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None) -> int:
    noise = exponential_rows(len(candidates), [generator])[0]
    return int(candidates[(scaled_row[candidates] - noise.log_()).argmax()])
