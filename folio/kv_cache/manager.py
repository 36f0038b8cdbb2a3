"""Maps requests to block tables, grows them as their sequences grow, and finds cached prefixes.

With prefix caching on, a request being admitted first takes every cached block of its longest
cached prefix (`find_cached_prefix`), and each block it fills afterwards is registered in the pool
(`cache_full_blocks`), so the next request with that prefix skips computing it.

When every layer attends through the same sliding window (Mistral v0.1, Phi-3), a block whose tokens
no later query can see is given back as soon as the request has computed past it (`drop_out_of_window`):
its place in the table is taken by a placeholder, one block shared by every such place, so the
runner's table keeps its shape and indices. Attention never reads a placeholder's keys unmasked (the
kernels start at the window's first key; the PyTorch path masks them), and the placeholder is a full,
computed block that nobody writes again, so what it holds is always finite. A request then holds at
most the window and the blocks it writes, whatever its length. (Gemma 3's global layers need every
block: with one table for all layers, a model that mixes window and global layers drops nothing.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from folio.kv_cache.block_pool import BlockPool
from folio.kv_cache.hashing import extend_block_keys

if TYPE_CHECKING:
    from folio.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None) -> None:  # fmt: skip
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's, or None: nothing is dropped
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already in the cache map
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens whose KV came from the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next forward
        self._num_dropped: dict[str, int] = {}  # leading blocks of each table replaced by the placeholder
        self._placeholder: int | None = None  # held once by the manager while any table has dropped blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def longest_request_tokens(self, max_num_batched_tokens: int) -> int | None:
        """The longest request the pool can always hold alone (None: any length). Past the window a
        request holds at most the window's blocks and those its step writes into, plus a partial one and
        the placeholder."""
        window = self.sliding_window
        if window is not None and self.blocks_needed(window - 1 + max_num_batched_tokens) + 2 <= self.pool.num_blocks:
            return None
        return self.capacity_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens. At least one token is
        always left to compute, so that there are logits to sample the next token from."""
        if not self.enable_prefix_caching:
            return []
        extend_block_keys(request.block_keys, request.all_token_ids(), self.block_size, request.cache_salt)
        blocks: list[int] = []
        for key in request.block_keys[: (request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self,
        request_id: str,
        total_tokens: int,
        cached_blocks: Sequence[int] = (),
        write_from: int | None = None,
    ) -> bool:
        """Make room for `total_tokens` tokens of KV, starting the table with `cached_blocks` (only
        for a request that holds no blocks yet). `write_from` is the first position written this step:
        if it falls inside a block another request also holds (a fork's last prompt block), that block
        is copied first. False, and nothing changed, if the pool is short."""
        table = self.block_tables.get(request_id, [])
        if cached_blocks and table:
            raise ValueError(f"request {request_id} already holds blocks; cached blocks start a table")
        missing = max(self.blocks_needed(total_tokens) - len(table) - len(cached_blocks), 0)
        copy_at = None
        index = None if write_from is None else write_from // self.block_size
        partial = write_from is not None and write_from % self.block_size != 0
        if partial and index is not None and index < len(table) and self.pool.ref_counts[table[index]] > 1:
            copy_at = index
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)  # leave the free list
        if missing + (copy_at is not None) > self.pool.num_free_blocks - revived:
            return False
        for block in cached_blocks:
            self.pool.touch(block)
        if cached_blocks:
            self._num_registered[request_id] = len(cached_blocks)
        table = table + list(cached_blocks) + self.pool.allocate(missing)
        if copy_at is not None:
            [copy] = self.pool.allocate(1)
            self.pending_copies.append((table[copy_at], copy))
            self.pool.free([table[copy_at]])  # still held by the other owners
            table[copy_at] = copy
        self.block_tables[request_id] = table
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child holds every block of the parent, by reference; writes into a shared partial
        block copy it first (see allocate_slots)."""
        table = list(self.block_tables[parent_id])
        for block in table:
            self.pool.share(block)
        self.block_tables[child_id] = table
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)
        if parent_id in self._num_dropped:
            self._num_dropped[child_id] = self._num_dropped[parent_id]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(request.request_id, 0)
        if full <= done:
            return
        extend_block_keys(request.block_keys, request.all_token_ids(), self.block_size, request.cache_salt)
        table = self.block_tables[request.request_id]
        for index in range(done, full):
            self.pool.register(table[index], request.block_keys[index])
        self._num_registered[request.request_id] = full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (slots of drafts the target rejected).
        They were never full and computed, so none is in the prefix cache."""
        table = self.block_tables[request_id]
        keep = self.blocks_needed(num_tokens)
        if len(table) > keep:
            self.pool.free(table[keep:])
            del table[keep:]

    def drop_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the request's blocks that fell out of the sliding window: the next query sits at
        `num_computed_tokens` and sees keys from `num_computed_tokens - window + 1` on. Call it after the
        step's blocks were registered (a dropped block keeps its prefix-cache key on the free list).
        Returns how many blocks went back to the pool."""
        table = self.block_tables.get(request_id)
        if self.sliding_window is None or not table:
            return 0
        first_seen = max(num_computed_tokens - self.sliding_window + 1, 0)
        done = self._num_dropped.get(request_id, 0)
        droppable = min(first_seen // self.block_size, len(table))
        freed = 0
        for index in range(done, droppable):
            block = table[index]
            if self._placeholder is None:  # the first block dropped becomes the placeholder itself
                self._placeholder = block
                self.pool.share(block)
            elif block != self._placeholder:
                self.pool.share(self._placeholder)
                self.pool.free([block])
                table[index] = self._placeholder
                freed += 1
        if droppable > done:
            self._num_dropped[request_id] = droppable
        return freed

    def free(self, request_id: str) -> None:
        self._num_registered.pop(request_id, None)
        self._num_dropped.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)
        if self._placeholder is not None and not self._num_dropped:
            self.pool.free([self._placeholder])  # no table uses it any more
            self._placeholder = None

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]
