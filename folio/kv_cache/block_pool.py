"""The pool of fixed-size KV blocks: reference counts and a free list.

The pool only hands out block ids; the tensors they index live in the model runner's KV cache.
"""

from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """A bookkeeping bug: freeing a free block, or allocating past the pool."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage_ratio(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise BlockPoolError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def share(self, block: int) -> None:
        """Another owner holds this block (copy-on-write sharing)."""
        if self.ref_counts[block] <= 0:
            raise BlockPoolError(f"block {block} is free and cannot be shared")
        self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        # Freed in reverse so a request's tail blocks are reused first and its head stays warm longer.
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise BlockPoolError(f"block {block} freed twice")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)
