"""Draws each row's token by an exponential race: argmax(p / E) with E ~ Exp(1) per token picks token i
with probability p_i. In logs that is argmax(scaled - log E), where the scaled logits are log p plus a
row constant, so no softmax is needed for the race itself.

Each row draws from its own generator, and as many values as the row itself decides, so a seeded
request gets the same tokens whatever shares its batch:
- a row that filters races among the tokens its top-k / top-p keep (40 values for top-k 40, not 262,144);
- a row that keeps every token first tosses a coin weighted by the mass of its best `HEAD` tokens, then
  races within the head or within the rest. That is the same distribution as one race over the whole
  row (a mixture of the two parts, each drawn in proportion), and the whole row's noise (~1.5 ms a row
  of 262,144 tokens) is drawn only when the tail wins the toss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from folio.sample.noise import exponential_rows
from folio.sample.top_k_top_p import KeptPrefix

HEAD = 1024


def race_kept(
    scaled: torch.Tensor, kept: KeptPrefix, rows: Sequence[int], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """The token of each of `rows` (rows that filter), raced among the tokens the row keeps only."""
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
    whole_row_is_head = head_index.shape[1] == part.shape[1]
    tokens = []
    for j, row in enumerate(rows):
        generator = generators[row]
        coin = float(torch.rand(1, generator=generator, dtype=torch.float64))
        tail_token = None
        if not whole_row_is_head and coin >= float(head_mass[j].sum(dtype=torch.float64)):
            tail_token = _race_tail(part[j], head_index[j], generator)
        # The head's mass rounds below 1 even when nothing is left past it (masks): then the head it is.
        tokens.append(_race(part[j], head_index[j], generator) if tail_token is None else tail_token)
    return tokens


def _race_tail(scaled_row: torch.Tensor, head: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """A race over the tokens outside `head`; None when none of them is possible."""
    tail = scaled_row.index_fill(0, head, float("-inf"))
    noise = exponential_rows(tail.shape[0], [generator])[0]
    token = int(tail.sub_(noise.log_()).argmax())
    return token if bool(torch.isfinite(tail[token])) else None


def _race(scaled_row: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator | None) -> int:
    noise = exponential_rows(len(candidates), [generator])[0]
    return int(candidates[(scaled_row[candidates] - noise.log_()).argmax()])
