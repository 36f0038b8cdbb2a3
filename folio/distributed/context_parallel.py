"""Context parallelism: one sequence's tokens, and their KV cache, spread over ranks.

Every rank holds the whole model; what is split is the tokens. Token position p belongs to rank
p % C (C ranks): that rank computes the token's row through every layer and keeps its keys and
values in its own cache. Each scheduler block of B tokens thus lives as B / C slots on each rank, so
a pool of the same memory per rank holds C times the context, and a prompt's rows, the projections,
MLPs and attention alike, divide evenly over the ranks whatever the chunk (interleaving balances the
causal triangle, which contiguous halves would not).

Attention is the one step that needs other ranks' tokens: each rank gathers every rank's queries,
attends them over the keys it holds, and the ranks swap those partial results (output and
log-sum-exp per query and head) so that each merges its own rows' parts (attention.py's
`merge_partials`). Ring attention passes keys around instead; with a paged cache holding a long
context, queries are the smaller thing to move: their bytes do not grow with the context.

`ContextSplit` is one step's plan: which rows each rank computes, where their K/V go, and the
gathers the attention and the LM head need. It is built by the model runner from plain positions
and block tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from folio.distributed.shm_reduce import SharedMemoryReducer
from folio.distributed.tensor_parallel import COMM


@dataclass(frozen=True)
class ContextParallel:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False)  # a torch.distributed ProcessGroup when size > 1
    shared: SharedMemoryReducer | None = field(default=None, compare=False)  # ranks on one CPU host

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (the same shape on each), stacked: [ranks, *x.shape]."""
        started = time.perf_counter()
        if self.shared is not None:
            joined = self.shared.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            joined = torch.stack(parts)
        COMM.add(started, x)
        return joined

    def all_to_all_rows(self, x: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """Rows `mine` of every rank's `x` [T, F]: [ranks, len(mine), F]."""
        if self.shared is None:
            return self.all_gather(x)[:, mine]  # gloo has no all-to-all: gather all, keep ours
        started = time.perf_counter()
        taken = self.shared.all_to_all_rows(x, mine)
        COMM.add(started, x)
        return taken


@dataclass
class ContextSplit:
    """One step's rows over the context-parallel ranks (flat rows are the scheduler's batch order)."""

    cp: ContextParallel
    owners: torch.Tensor  # [T] the rank that computes each flat row
    index_in_owner: torch.Tensor  # [T] each row's place among its owner's rows
    local_rows: torch.Tensor  # [n] the flat rows this rank computes, in order
    slots: torch.Tensor  # [n] the cache slot (of this rank's cache) each of them writes
    block_size: int  # tokens per scheduler block: block_size // ranks slots of it on each rank

    @property
    def num_local(self) -> int:
        return self.local_rows.numel()

    @property
    def input_rows(self) -> torch.Tensor:
        """The flat rows this rank feeds the model: its own, or row 0 as a stand-in when it has none
        (every rank must run every layer's exchanges; a stand-in writes nothing and is discarded)."""
        return self.local_rows if self.num_local else torch.zeros(1, dtype=torch.long)

    @property
    def slots_per_block(self) -> int:
        return self.block_size // self.cp.size

    @property
    def num_rows(self) -> int:
        return self.owners.numel()

    def key_positions(self, num_blocks: int) -> torch.Tensor:
        """[num_blocks * slots_per_block]: the position whose key sits in each slot of this rank's
        cache, reading a block table of `num_blocks` blocks in order."""
        blocks = torch.arange(num_blocks).unsqueeze(1) * self.block_size
        offsets = torch.arange(self.slots_per_block).unsqueeze(0) * self.cp.size + self.cp.rank
        return (blocks + offsets).flatten()

    def gather_rows(self, local: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T, *rest]: the flat `rows` (default: all), each from the rank that computed it, out of
        every rank's `local` [n (or the stand-in's 1), *rest]; rows not asked for are zero."""
        rows = torch.arange(self.num_rows) if rows is None else rows
        owners = self.owners[rows]
        per_rank = [rows[owners == r] for r in range(self.cp.size)]
        padded = max(1, *(p.numel() for p in per_rank))
        mine = local[self.index_in_owner[per_rank[self.cp.rank]]]
        sent = local.new_zeros(padded, *local.shape[1:])
        sent[: mine.shape[0]] = mine
        every = self.cp.all_gather(sent)
        out = local.new_zeros(self.num_rows, *local.shape[1:])
        for rank, wanted in enumerate(per_rank):
            out[wanted] = every[rank, : wanted.numel()]
        return out

    def own_rows_from_every(self, partial: torch.Tensor) -> torch.Tensor:
        """Every rank's `partial` [T, F] (one row per flat row) -> this rank's rows of each:
        [ranks, n, F]."""
        return self.cp.all_to_all_rows(partial, self.local_rows)


def build_context_split(
    cp: ContextParallel, positions: list[int], tables: list[list[int]], block_size: int
) -> ContextSplit:
    """`positions` and `tables`: each flat row's position and its sequence's block table."""
    size = cp.size
    if block_size % size:
        raise ValueError(f"a block of {block_size} tokens does not split over {size} context-parallel ranks")
    owners = [p % size for p in positions]
    seen = [0] * size
    index_in_owner = []
    for owner in owners:
        index_in_owner.append(seen[owner])
        seen[owner] += 1
    local = [row for row, owner in enumerate(owners) if owner == cp.rank]
    per_block = block_size // size
    slots = [tables[row][positions[row] // block_size] * per_block + positions[row] % block_size // size
             for row in local]  # fmt: skip
    return ContextSplit(
        cp,
        torch.tensor(owners, dtype=torch.long),
        torch.tensor(index_in_owner, dtype=torch.long),
        torch.tensor(local, dtype=torch.long),
        torch.tensor(slots, dtype=torch.long),
        block_size,
    )
