"""The pool of fixed-size KV blocks: reference counts, an LRU free list and the prefix-cache map.

The pool only hands out block ids; the tensors they index live in the model runner's KV cache.
A full block whose KV is computed can be registered under its `BlockKey`. When its last owner frees
it, it keeps that key on the free list, so a later request with the same prefix can take it back
(`touch`) instead of recomputing it, until the block is handed out for something else (evicted).
A model with several KV cache groups caches each group's blocks under its own keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from folio.kv_cache.hashing import BlockKey

# A cached block's identity: its KV cache group (groups.py; 0 in a model with one) and its key.
CacheKey = tuple[int, BlockKey]


class BlockPoolError(RuntimeError):
    """A bookkeeping bug: freeing a free block, or allocating past the pool."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.keys: list[CacheKey | None] = [None] * num_blocks
        # Free blocks, least recently freed first: allocation evicts from the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[CacheKey, int] = {}
        # Told of each cached block the pool evicts, while its KV is still intact (the host tier's store).
        self.on_evict: Callable[[int, CacheKey], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out, including cached ones nobody holds."""
        return len(self._free)

    @property
    def usage_ratio(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise BlockPoolError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """Another owner holds this block (copy-on-write sharing)."""
        if self.ref_counts[block] <= 0:
            raise BlockPoolError(f"block {block} is free and cannot be shared")
        self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        # Freed in reverse, so a request's tail blocks are evicted before its head: heads are the
        # prefixes other requests are likeliest to share.
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise BlockPoolError(f"block {block} freed twice")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    # -- prefix cache ------------------------------------------------------------------------------
    def lookup(self, key: BlockKey, group: int = 0) -> int | None:
        return self._cached.get((group, key))

    def touch(self, block: int) -> None:
        """Take a cached block for a new owner, reviving it from the free list if nobody held it."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def register(self, block: int, key: BlockKey, group: int = 0) -> None:
        """Record that `block` holds the computed KV of `key` for KV cache group `group`. If another
        block already does, the cache keeps that one and this block stays anonymous."""
        if self.ref_counts[block] <= 0:
            raise BlockPoolError(f"block {block} is free and cannot be registered")
        if self.keys[block] is None and (group, key) not in self._cached:
            self._cached[group, key] = block
            self.keys[block] = (group, key)

    def _forget(self, block: int) -> None:
        key = self.keys[block]
        if key is not None:
            del self._cached[key]
            self.keys[block] = None
            if self.on_evict is not None:
                self.on_evict(block, key)
