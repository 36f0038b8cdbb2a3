"""The tensor-parallel group a model's layers are built for, and its two collectives.

A layer learns its rank and group size when it is constructed (`building(tp)` scopes the group a
model is built for; outside it the group is one rank), so a draft model built beside a sharded
target stays whole. With one rank every collective is the identity and costs nothing.

Collectives run on torch.distributed (gloo on CPU, NCCL on CUDA), or, between ranks on one CPU
host, through shared memory (shm_reduce.py). Their wall time is counted in
`COMM` so that a benchmark can report the share of a step spent communicating.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from folio.distributed.shm_reduce import SharedMemoryReducer


@dataclass
class CommStats:
    """Collectives run by this process since start (or the last reset)."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def add(self, started: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()


COMM = CommStats()


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False)  # a torch.distributed ProcessGroup when size > 1
    # Ranks on one CPU host exchange through shared memory instead (shm_reduce.py); None: the group.
    shared: SharedMemoryReducer | None = field(default=None, compare=False)

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(first index, count) of this rank's even share of `total` items."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) does not divide by the tensor-parallel size {self.size}")
        share = total // self.size
        return self.rank * share, share

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place)."""
        if self.size == 1:
            return x
        started = time.perf_counter()
        if self.shared is not None:
            self.shared.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        COMM.add(started, x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` joined along the last dimension, in rank order."""
        if self.size == 1:
            return x
        started = time.perf_counter()
        x = x.contiguous()
        if self.shared is not None:
            joined = self.shared.all_gather_last(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            joined = torch.cat(parts, dim=-1)
        COMM.add(started, x)
        return joined


SINGLE = TensorParallel()
_building = SINGLE


def current() -> TensorParallel:
    """The group the layers being constructed now belong to."""
    return _building


@contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Construct a model's layers for `tp` inside this block."""
    global _building
    previous, _building = _building, tp
    try:
        yield
    finally:
        _building = previous


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: its query heads and KV heads, and where they start."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int


def head_shard(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """Query heads split evenly; KV heads split too, or, when there are fewer KV heads than ranks,
    each replicated on the ranks whose query heads read it (Gemma 3 has one)."""
    if not fits_heads(num_heads, num_kv_heads, tp.size):
        valid = [n for n in range(1, num_heads + 1) if fits_heads(num_heads, num_kv_heads, n)]
        raise ValueError(
            f"a tensor-parallel size of {tp.size} does not split {num_heads} attention heads with "
            f"{num_kv_heads} KV heads; valid sizes for this model: {', '.join(map(str, valid))}"
        )
    heads = num_heads // tp.size
    if num_kv_heads >= tp.size:
        kv_heads = num_kv_heads // tp.size
        return HeadShard(heads, kv_heads, tp.rank * heads, tp.rank * kv_heads)
    return HeadShard(heads, 1, tp.rank * heads, tp.rank // (tp.size // num_kv_heads))


def fits_heads(num_heads: int, num_kv_heads: int, size: int) -> bool:
    if num_heads % size:
        return False
    return num_kv_heads % size == 0 if num_kv_heads >= size else size % num_kv_heads == 0
