"""The shared-memory exchange against plain sums: two processes, tensors smaller and larger than a
slot (chunked), all-reduce and all-gather, many collectives in a row (both parities reused)."""

from __future__ import annotations

import multiprocessing as mp

import torch

from folio.distributed.shm_reduce import SLOT_BYTES, SharedMemoryReducer

SIZES = [7, 640 * 3, SLOT_BYTES // 4 + 1000, 5]  # the third is chunked


def _part(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32).view(-1, 1) * (rank + 1) + step


def _rank(rank: int, name: str, results) -> None:
    reducer = SharedMemoryReducer(rank, 2, name)
    checks = []
    for step, numel in enumerate(SIZES):
        summed = reducer.all_reduce(_part(rank, step, numel))
        checks.append(torch.equal(summed, _part(0, step, numel) + _part(1, step, numel)))
        gathered = reducer.all_gather_last(_part(rank, step, numel).view(1, -1)[:, :9])
        expected = torch.cat([_part(r, step, numel).view(1, -1)[:, :9] for r in range(2)], dim=-1)
        checks.append(torch.equal(gathered, expected))
    for shape in [(40, 131072), (3, SLOT_BYTES // 4 + 9), (0, 5)]:  # many chunks of rows; a row over a slot; none
        mine = torch.randn(shape, generator=torch.Generator().manual_seed(rank))
        expected = torch.cat([torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(2)], -1)
        checks.append(torch.equal(reducer.all_gather_last(mine), expected))
    rows = torch.randn(50, SLOT_BYTES // 4 // 20, generator=torch.Generator().manual_seed(rank))  # 3 chunks
    every = [torch.randn(rows.shape, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    checks.append(torch.equal(reducer.all_gather(rows), torch.stack(every)))
    mine = torch.arange(rank, 50, 2)  # interleaved rows, as context parallelism owns them
    checks.append(torch.equal(reducer.all_to_all_rows(rows, mine), torch.stack([e[mine] for e in every])))
    results.put((rank, checks))


def test_two_ranks_reduce_and_gather_exactly():
    owner = SharedMemoryReducer(0, 2)  # created here, attached by both ranks below
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, owner.name, results)) for r in range(2)]
    for process in ranks:
        process.start()
    got = dict(results.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
    owner.unlink()
    assert got == {0: [True] * (2 * len(SIZES) + 5), 1: [True] * (2 * len(SIZES) + 5)}
