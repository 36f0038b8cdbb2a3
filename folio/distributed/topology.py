"""Where a rank sits in a split model: its pipeline stage and its tensor-parallel group, or its place
among the ranks a context is split over.

Global rank = stage * tp_size + tp_rank (vLLM's order): the ranks of a stage are neighbours, so on
several hosts a stage's collectives stay within a host whenever a host holds whole stages, and only
the stages' point-to-point sends cross the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from folio.distributed import wire
from folio.distributed.context_parallel import ContextParallel
from folio.distributed.pipeline_parallel import PipelineStage
from folio.distributed.shm_reduce import SharedMemoryReducer
from folio.distributed.tensor_parallel import TensorParallel

_READ_NAME = wire.decoder(tuple[int, str] | None)  # a stage's shared-memory segment, from its first rank


@dataclass(frozen=True)
class RankRole:
    tp: TensorParallel
    stage: PipelineStage
    context: ContextParallel = ContextParallel()

    @property
    def reports(self) -> bool:
        """Whether this rank sends the step's result (the last stage's first rank)."""
        return self.stage.is_last and self.tp.rank == 0 and self.context.rank == 0


def join_context(rank: int, cp_size: int, control: Any, use_shared_memory: bool) -> RankRole:
    """A rank of a context split over every rank (the whole model on each)."""
    shared = _shared_memory(rank, cp_size, 0, control) if use_shared_memory else None
    context = ContextParallel(rank, cp_size, dist.group.WORLD, shared)
    return RankRole(TensorParallel(), PipelineStage(), context)


def join_groups(
    rank: int, tp_size: int, pp_size: int, control: Any, use_shared_memory: bool, layer_counts: tuple[int, ...] | None
) -> RankRole:
    """Create every stage's tensor-parallel group (torch.distributed needs every rank to create every
    group, in the same order) and, with `use_shared_memory`, each stage's shared-memory exchange."""
    stage, tp_rank = divmod(rank, tp_size)
    group: Any = dist.group.WORLD
    if pp_size > 1 and tp_size > 1:
        for s in range(pp_size):
            made = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)))
            if s == stage:
                group = made
    shared = _shared_memory(tp_rank, tp_size, stage, control) if use_shared_memory and tp_size > 1 else None
    prev_rank = rank - tp_size if stage > 0 else None
    next_rank = rank + tp_size if stage < pp_size - 1 else None
    stage_place = PipelineStage(stage, pp_size, prev_rank, next_rank, layer_counts)
    return RankRole(TensorParallel(tp_rank, tp_size, group, shared), stage_place)


def _shared_memory(tp_rank: int, tp_size: int, stage: int, control: Any) -> SharedMemoryReducer:
    """Each stage's first rank creates its stage's segment; every rank learns every stage's name."""
    reducer = SharedMemoryReducer(0, tp_size) if tp_rank == 0 else None
    names = wire.all_gather((stage, reducer.name) if reducer is not None else None, _READ_NAME, control)
    if reducer is None:
        name = next(found[1] for found in names if found is not None and found[0] == stage)
        reducer = SharedMemoryReducer(tp_rank, tp_size, name)
    dist.barrier(group=control)
    if tp_rank == 0:
        reducer.unlink()  # every rank holds it now; the name goes, the memory stays until the last exits
    return reducer
