"""One step with the context split over ranks (folio/distributed/context_parallel.py): this rank runs
the rows whose positions it holds, the attention layers exchange what they need, and the rows the LM
head reads come back from whichever rank computed them, so that sampling sees the step's rows as if
one process had run them all; the LM head's rows are then dealt out over the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from folio.distributed.context_parallel import ContextParallel, build_context_split
from folio.layers.attention.metadata import AttentionMetadata


def run_split_context(
    model: torch.nn.Module,
    cp: ContextParallel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    tables: list[list[int]],
    block_size: int,
    scored_rows: list[int],
) -> torch.Tensor:
    """The final hidden states [T, hidden] of `scored_rows` (the rows whose logits the step needs),
    zero elsewhere. `tables`: each flat row's block table; `meta`: the step's groups over every row."""
    split = build_context_split(cp, positions.tolist(), tables, block_size)
    rows = split.input_rows
    hidden = model(input_ids[rows], positions[rows], dataclasses.replace(meta, context=split))
    return split.gather_rows(hidden, torch.tensor(sorted(scored_rows), dtype=torch.long))


def split_over_ranks(
    cp: ContextParallel,
    rows: torch.Tensor,
    compute: Callable[[torch.Tensor], torch.Tensor],
    tail: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """`compute(rows)` [N, *tail] with the rows dealt out over the ranks: `rows` [N, hidden] is the same
    on every rank (gathered hidden states), each rank computes every C-th row, and the results are
    gathered back in order. The LM head is the work this divides: without it every rank would compute
    every sampled row's logits (a third of a batch-64 step for Gemma 3's 262k vocabulary)."""
    count = rows.shape[0]
    share = -(-count // cp.size)
    sent = torch.zeros(share, *tail, dtype=dtype)
    mine = rows[cp.rank :: cp.size]
    if mine.shape[0]:  # a rank with no row computes nothing (the kernels take no empty batch)
        sent[: mine.shape[0]] = compute(mine)
    every = cp.all_gather(sent)
    out = torch.empty(count, *tail, dtype=dtype)
    for rank in range(cp.size):
        out[rank :: cp.size] = every[rank, : len(range(rank, count, cp.size))]
    return out
