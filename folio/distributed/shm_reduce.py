"""All-reduce and all-gather through shared memory, for ranks on one CPU host.

Over loopback TCP a gloo collective of a batch-1 step took ~1.7 ms on this machine (`folio bench
parallel`, docs/benchmarks.md), and a split model runs two per layer per step: more than the layer's
arithmetic at small batches. vLLM's CPU backend reduces through shared memory for the same reason;
this is the same idea in torch.

Layout of the segment: one 64-byte flag per rank (the number of the last collective it has written),
then, for each of two parities, one slot per rank of `SLOT_BYTES`. A collective writes this rank's
part into its slot of parity `seq % 2`, publishes `seq` in its flag, waits until every flag reaches
`seq`, and reads every slot. Two parities make one wait per collective enough: a rank can only
overwrite a slot (at seq + 2) after every rank has published seq + 1, that is, after every rank has
finished reading seq. Tensors larger than a slot go in chunks. Every rank sums the slots in rank
order, so all ranks get bit-identical results.
"""

from __future__ import annotations

import os
import time
import uuid
from multiprocessing import shared_memory

import numpy as np
import torch

FLAG_STRIDE = 8  # int64s per flag: one cache line, so ranks never write the same line
SLOT_BYTES = 4 << 20
FAST_SPINS = 2000  # then yield the core at each check (more ranks than cores must still progress)
TIMEOUT_SECONDS = 600.0


class SharedMemoryReducer:
    def __init__(self, rank: int, world_size: int, name: str | None = None) -> None:
        """Rank 0 creates the segment (`name` None) and hands its `name` to the others, who attach."""
        self.rank, self.world_size = rank, world_size
        flag_bytes = 64 * world_size
        size = flag_bytes + 2 * world_size * SLOT_BYTES
        if name is None:
            self.shm = shared_memory.SharedMemory(name=f"folio-tp-{uuid.uuid4().hex[:12]}", create=True, size=size)
        else:
            # Attaching registers the name with the resource tracker that every rank shares with the
            # engine (spawned children use their parent's); rank 0's unlink unregisters it once for all.
            self.shm = shared_memory.SharedMemory(name=name)
        self.name = self.shm.name
        self.flags = np.ndarray((world_size * FLAG_STRIDE,), dtype=np.int64, buffer=self.shm.buf)
        if name is None:
            self.flags[:] = 0
        self.bytes = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=flag_bytes,
                                      count=2 * world_size * SLOT_BYTES)  # fmt: skip
        self.seq = 0

    def unlink(self) -> None:
        """Remove the name once every rank has attached (the memory lives until the last one closes)."""
        self.shm.unlink()

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        start = (parity * self.world_size + rank) * SLOT_BYTES
        return self.bytes[start : start + count * dtype.itemsize].view(dtype)

    def _exchange(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Publish this rank's `chunk` (flat, at most a slot) and return every rank's, in rank order."""
        self.seq += 1
        parity = self.seq % 2
        self._slot(parity, self.rank, chunk.dtype, chunk.numel()).copy_(chunk)
        self.flags[self.rank * FLAG_STRIDE] = self.seq
        self._wait(self.seq)
        return [self._slot(parity, r, chunk.dtype, chunk.numel()) for r in range(self.world_size)]

    def _wait(self, seq: int) -> None:
        flags = self.flags[::FLAG_STRIDE]
        spins = 0
        started = time.monotonic()
        while (flags < seq).any():
            spins += 1
            if spins > FAST_SPINS:
                os.sched_yield()
                if spins % 10000 == 0 and time.monotonic() - started > TIMEOUT_SECONDS:
                    raise TimeoutError(f"rank {self.rank}: the other ranks never reached collective {seq}")

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        per_chunk = SLOT_BYTES // flat.element_size()
        return [flat[i : i + per_chunk] for i in range(0, flat.numel(), per_chunk)] or [flat]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        for chunk in self._chunks(flat):
            parts = self._exchange(chunk)  # this rank's part is in its slot: `chunk` may be overwritten
            if len(parts) == 1:
                continue
            torch.add(parts[0], parts[1], out=chunk)  # one pass: the sum written where the result goes
            for part in parts[2:]:
                chunk += part
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` joined along the last dimension, in rank order."""
        x = x.contiguous()
        width = x.shape[-1]
        rows = x.view(-1, width)
        rows_per_chunk = SLOT_BYTES // max(1, width * x.element_size())
        if rows_per_chunk == 0:  # a row larger than a slot: gather whole, then lay the parts side by side
            return self.all_gather(x).movedim(0, -2).reshape(*x.shape[:-1], self.world_size * width)
        joined = torch.empty(rows.shape[0], self.world_size, width, dtype=x.dtype)
        for first in range(0, rows.shape[0], rows_per_chunk):  # each rank's rows straight to their place
            block = rows[first : first + rows_per_chunk]
            for rank, part in enumerate(self._exchange(block.reshape(-1))):
                joined[first : first + block.shape[0], rank].copy_(part.view_as(block))
        return joined.view(*x.shape[:-1], self.world_size * width)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (the same shape on each), stacked in rank order: [ranks, *x.shape]."""
        flat = x.contiguous().view(-1)
        joined = torch.empty(self.world_size, flat.numel(), dtype=x.dtype)
        offset = 0
        for chunk in self._chunks(flat):
            for rank, part in enumerate(self._exchange(chunk)):
                joined[rank, offset : offset + chunk.numel()].copy_(part)
            offset += chunk.numel()
        return joined.view(self.world_size, *x.shape)

    def all_to_all_rows(self, x: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """Every rank publishes all rows of `x` [T, F] (the same shape on each) and reads back only the
        rows `mine` (sorted row indices) of each: [ranks, len(mine), F]. Nothing else is copied."""
        x = x.contiguous()
        width = x.shape[1]
        out = torch.empty(self.world_size, mine.numel(), width, dtype=x.dtype)
        rows_per_chunk = SLOT_BYTES // max(1, width * x.element_size())
        if rows_per_chunk == 0:  # a row larger than a slot
            return self.all_gather(x)[:, mine]
        for first in range(0, x.shape[0], rows_per_chunk):
            block = x[first : first + rows_per_chunk]
            lo, hi = torch.searchsorted(mine, torch.tensor([first, first + block.shape[0]])).tolist()
            for rank, part in enumerate(self._exchange(block.reshape(-1))):
                if hi > lo:
                    out[rank, lo:hi] = part.view_as(block)[mine[lo:hi] - first]
        return out
