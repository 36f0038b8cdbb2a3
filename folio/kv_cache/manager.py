"""Maps requests to block tables, grows them as their sequences grow, and finds cached prefixes.

With prefix caching on, a request being admitted first takes every cached block of its longest
cached prefix (`find_cached_prefix`), and each block it fills afterwards is registered in the pool
(`cache_full_blocks`), so the next request with that prefix skips computing it.

A request has one block table per KV cache group (groups.py): one for most models, several for a model
that mixes sliding-window and global layers. The tables of a request always have the same length (a
block per `block_size` positions) and grow together, each from the one pool.

In a group whose layers attend through a sliding window (every layer of Mistral v0.1 and Phi-3, the
window layers of Gemma 3), a block whose tokens no later query can see is given back as soon as the
request has computed past it (`drop_out_of_window`): its place in the table is taken by a placeholder,
one block shared by every such place, so the runner's table keeps its shape and indices. Attention
never reads a placeholder's keys unmasked (the kernels start at the window's first key; the PyTorch
path masks them), and the placeholder is a full, computed block that nobody writes again, so what it
holds is always finite. A window group's table then holds at most the window and the blocks it
writes, whatever the request's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from folio.kv_cache.block_pool import BlockPool, CacheKey
from folio.kv_cache.disk_tier import DiskTier
from folio.kv_cache.hashing import BlockKey, extend_block_keys
from folio.kv_cache.host_tier import HostTier
from folio.kv_cache.tier_ops import TierOps

if TYPE_CHECKING:
    from folio.engine.request import Request

# One request's tables, a list of block ids per KV cache group.
Tables = list[list[int]]
# In a cached prefix (find_cached_prefix): a window group's place that allocate_slots fills with the
# placeholder block, its tokens being out of the window already.
PLACEHOLDER = -1


def window_blocks_held(window: int, step_tokens: int, block_size: int) -> int:
    """The most blocks a window group's table holds past its window: those of the `window - 1` keys the
    step's first query sees, those its `step_tokens` are written into, and a partial one (the
    placeholder apart)."""
    return -(-(window - 1 + step_tokens) // block_size) + 1


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 group_windows: Sequence[int | None] = (None,)) -> None:  # fmt: skip
        """`group_windows`: each KV cache group's sliding window, or None where its layers see everything."""
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, Tables] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already in the cache map
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of those, tokens whose KV came from the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next forward
        self._num_dropped: dict[str, list[int]] = {}  # per group: leading blocks now the placeholder
        self._placeholder: int | None = None  # held once by the manager while any table has dropped blocks
        self.tier: HostTier | None = None  # the host-RAM tier under the pool (attach_tier)
        self.disk: DiskTier | None = None  # the disk tier under the RAM tier (attach_disk)
        # Until admitted: request id -> the keys of its prefix read from disk for it (tiers_ready).
        self._awaiting: dict[str, set[CacheKey]] = {}

    def attach_tier(self, tier: HostTier) -> None:
        """Keep the blocks the pool evicts from the prefix cache in `tier`, and find prefixes there too."""
        if self.num_groups != 1:
            raise ValueError("a host-RAM KV tier needs one block table per request (this model's sliding-window "
                             "layers keep their own: pass --no-hybrid-kv-cache)")  # fmt: skip
        if not self.enable_prefix_caching:
            raise ValueError("a host-RAM KV tier keeps prefix-cache blocks: it needs prefix caching on")
        self.tier = tier
        self.pool.on_evict = tier.store

    def attach_disk(self, disk: DiskTier) -> None:
        """Write each block the prefix cache registers to `disk` too, and read prefixes back from it."""
        if self.tier is None or disk.host is not self.tier:
            raise ValueError("a disk KV tier stages its reads in the host-RAM tier: attach that first")
        self.disk = disk

    def take_tier_ops(self) -> TierOps:
        """What the runner does for the tiers: before the next forward, or (the disk tier's saves of the
        blocks a step just computed) right after the step."""
        if self.tier is None:
            return TierOps()
        if self.disk is None:
            return TierOps(copies=self.tier.take_ops())
        saves, loads, removes = self.disk.take_ops()
        return TierOps(saves, self.tier.take_ops(), loads, removes)

    def tiers_ready(self, request: Request) -> bool:
        """False while blocks of the request's prefix are being read from disk: it waits, the batch goes
        on. The first call starts the reads; the blocks read stay pinned in the RAM tier until the request
        is admitted (or leaves), so that other traffic cannot push them out before it gets in."""
        if self.disk is None or request.sampling_params.reads_every_prompt_position:
            return True
        awaited = self._awaiting.get(request.request_id)
        if awaited is None:
            num_cached = len(self.find_cached_prefix(request)[0])
            keys = request.block_keys[num_cached : (request.num_tokens - 1) // self.block_size]
            awaited = self._awaiting[request.request_id] = self.disk.prefetch(keys)
        return not awaited & self.disk.loading

    def finish_disk_reads(self, results: Sequence[tuple[int, bool]]) -> None:
        """The runner's reads from disk that ended: (RAM-tier slot, whether it holds its block now)."""
        assert self.disk is not None and self.tier is not None
        if not results:  # every step asks; most steps have nothing
            return
        awaited = set().union(*self._awaiting.values())
        self.tier.pin([key for key in self.disk.finish(results) if key in awaited])

    def _unpin(self, keys: set[CacheKey]) -> None:
        """Unpin `keys` in the RAM tier, but those a request not yet admitted waits for."""
        assert self.tier is not None
        self.tier.unpin(keys.difference(*self._awaiting.values()))

    @property
    def tier_loads_pending(self) -> bool:
        return self.disk is not None and bool(self.disk.loading)

    @property
    def drops_blocks(self) -> bool:
        """Whether some group slides, so that blocks behind its window go back to the pool."""
        return any(w is not None for w in self.group_windows)

    @property
    def capacity_tokens(self) -> int:
        """The tokens the pool holds when every group keeps every block (requests within the window)."""
        return self.pool.num_blocks // self.num_groups * self.block_size

    def longest_request_tokens(self, max_num_batched_tokens: int) -> int | None:
        """The longest request the pool can always hold alone (None: any length). Past its window a
        window group's table holds at most the window's blocks and those its step writes into, plus a
        partial one; the placeholder is one more block, whatever the number of groups."""
        windows = [w for w in self.group_windows if w is not None]
        if not windows:
            return self.capacity_tokens
        bounded = sum(window_blocks_held(w, max_num_batched_tokens, self.block_size) for w in windows) + 1
        num_global = self.num_groups - len(windows)
        if num_global == 0:
            return None if bounded <= self.pool.num_blocks else self.capacity_tokens
        past_window = (self.pool.num_blocks - bounded) // num_global * self.block_size
        return max(self.capacity_tokens, past_window)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks one table needs for `num_tokens` positions (each group's table needs as many)."""
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> Tables:
        """Each group's cached blocks holding the longest prefix of the request's tokens that every group
        can serve. At least one token is always left to compute, so that there are logits to sample the
        next token from. A window group needs only the blocks the first computed token's window reaches:
        the places before them hold `PLACEHOLDER`, for `allocate_slots` to fill (vLLM's sliding-window
        hits work the same way), so a prefix whose early window blocks were evicted is still a hit."""
        tables: Tables = [[] for _ in self.group_windows]
        if not self.enable_prefix_caching:
            return tables
        extend_block_keys(request.block_keys, request.all_token_ids(), self.block_size, request.prefix_salt)
        keys = request.block_keys[: (request.num_tokens - 1) // self.block_size]
        found = [[self.pool.lookup(key, group) for key in keys] for group in range(self.num_groups)]
        hit = len(keys)
        for window, blocks in zip(self.group_windows, found, strict=True):
            if window is None and None in blocks:
                hit = min(hit, blocks.index(None))
        while hit > 0 and not all(
            None not in blocks[self._first_seen_block(hit, window) : hit]
            for window, blocks in zip(self.group_windows, found, strict=True)
            if window is not None
        ):
            hit -= 1
        for window, blocks, table in zip(self.group_windows, found, tables, strict=True):
            first = self._first_seen_block(hit, window) if window is not None else 0
            table.extend([PLACEHOLDER] * first + blocks[first:hit])  # type: ignore[list-item]
        needs_placeholder = any(PLACEHOLDER in table for table in tables)
        if needs_placeholder and self._placeholder is None and not any(b >= 0 for t in tables for b in t):
            return [[] for _ in self.group_windows]  # no block to make the placeholder of: nothing to reuse
        return tables

    def find_in_tier(self, request: Request, num_cached_blocks: int) -> list[BlockKey]:
        """The keys of the blocks right after the request's `num_cached_blocks` cached ones that the host
        tier holds, up to the first it lacks (the last prompt token is always computed)."""
        if self.tier is None:
            return []
        keys = request.block_keys[: (request.num_tokens - 1) // self.block_size]
        found = []
        for key in keys[num_cached_blocks:]:
            if (0, key) not in self.tier:
                break
            found.append(key)
        return found

    def _first_seen_block(self, num_blocks: int, window: int) -> int:
        """After a prefix of `num_blocks` whole blocks, the first block the next query's window reaches."""
        return min(max(num_blocks * self.block_size - window + 1, 0) // self.block_size, num_blocks)

    def allocate_slots(
        self,
        request_id: str,
        total_tokens: int,
        cached_blocks: Sequence[Sequence[int]] = (),
        write_from: int | None = None,
        from_tier: Sequence[BlockKey] = (),
    ) -> bool:
        """Make room for `total_tokens` tokens of KV in every group's table, starting the tables with
        `cached_blocks` (one list per group, only for a request that holds no blocks yet), then blocks
        loaded from the host tier for the keys `from_tier` (find_in_tier), registered in the prefix cache
        as they are loaded. `write_from`
        is the first position written this step: if it falls inside a block another request also holds
        (a fork's last prompt block), that block is copied first. False, and nothing changed, if the pool
        is short."""
        tables = self.block_tables.get(request_id)
        cached = [list(c) for c in cached_blocks] if cached_blocks else [[] for _ in self.group_windows]
        if tables is None:
            tables = [[] for _ in self.group_windows]
        elif any(cached):
            raise ValueError(f"request {request_id} already holds blocks; cached blocks start a table")
        held = len(tables[0]) + len(cached[0])
        missing = max(self.blocks_needed(total_tokens) - held, 0)
        copy_at = None  # a partial block being written into, which others may hold too
        if (
            write_from is not None
            and write_from % self.block_size != 0
            and write_from // self.block_size < len(tables[0])
        ):
            copy_at = write_from // self.block_size
        copies = [] if copy_at is None else [g for g, t in enumerate(tables) if self.pool.ref_counts[t[copy_at]] > 1]
        real = {b for table in cached for b in table if b != PLACEHOLDER}
        revived = sum(1 for b in real if self.pool.ref_counts[b] == 0)  # they leave the free list
        if missing * self.num_groups + len(copies) > self.pool.num_free_blocks - revived:
            return False
        placeholders = [table.count(PLACEHOLDER) for table in cached]
        if any(placeholders) and self._placeholder is None:  # a cached block, full and computed, becomes it
            self._placeholder = min(real)
            self.pool.touch(self._placeholder)
        for table in cached:
            for index, block in enumerate(table):
                if block == PLACEHOLDER:
                    assert self._placeholder is not None
                    table[index] = self._placeholder
                    self.pool.share(self._placeholder)
                else:
                    self.pool.touch(block)
        if any(placeholders):
            self._num_dropped[request_id] = placeholders
        if cached[0] or from_tier:
            self._num_registered[request_id] = len(cached[0]) + len(from_tier)
        pinned = {(0, key) for key in from_tier}
        if self.tier is not None:
            self.tier.pin(pinned)  # the blocks this allocation evicts must not push them out of the tier
        tables = [table + extra + self.pool.allocate(missing) for table, extra in zip(tables, cached, strict=True)]
        if from_tier:
            assert self.tier is not None and self.num_groups == 1
            start = len(cached[0])
            for key, block in zip(from_tier, tables[0][start : start + len(from_tier)], strict=True):
                self.tier.load((0, key), block)
                self.pool.register(block, key)
        if (awaited := self._awaiting.pop(request_id, None)) is not None:  # admitted
            pinned |= awaited
        if pinned:
            self._unpin(pinned)
        for group in copies:
            assert copy_at is not None
            table = tables[group]
            [copy] = self.pool.allocate(1)
            self.pending_copies.append((table[copy_at], copy))
            self.pool.free([table[copy_at]])  # still held by the other owners
            table[copy_at] = copy
        self.block_tables[request_id] = tables
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child holds every block of the parent, by reference; writes into a shared partial
        block copy it first (see allocate_slots)."""
        tables = [list(table) for table in self.block_tables[parent_id]]
        for table in tables:
            for block in table:
                self.pool.share(block)
        self.block_tables[child_id] = tables
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)
        if parent_id in self._num_dropped:
            self._num_dropped[child_id] = list(self._num_dropped[parent_id])

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full and computed, in every group."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(request.request_id, 0)
        if full <= done:
            return
        extend_block_keys(request.block_keys, request.all_token_ids(), self.block_size, request.prefix_salt)
        for group, table in enumerate(self.block_tables[request.request_id]):
            for index in range(done, full):
                block, key = table[index], request.block_keys[index]
                self.pool.register(block, key, group)
                if self.disk is not None and self.pool.keys[block] == (group, key):
                    self.disk.save(block, (group, key))
        self._num_registered[request.request_id] = full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past the first `num_tokens` tokens (slots of drafts the target rejected).
        They were never full and computed, so none is in the prefix cache."""
        keep = self.blocks_needed(num_tokens)
        for table in self.block_tables[request_id]:
            if len(table) > keep:
                self.pool.free(table[keep:])
                del table[keep:]

    def drop_out_of_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the blocks of the request's window groups that fell out of their window: the next
        query sits at `num_computed_tokens` and sees keys from `num_computed_tokens - window + 1` on. Call
        it after the step's blocks were registered (a dropped block keeps its prefix-cache key on the free
        list). Returns how many blocks went back to the pool."""
        tables = self.block_tables.get(request_id)
        if not self.drops_blocks or not tables or not tables[0]:
            return 0
        done = self._num_dropped.get(request_id) or [0] * self.num_groups
        dropped, freed = list(done), 0
        for group, (window, table) in enumerate(zip(self.group_windows, tables, strict=True)):
            if window is None:
                continue
            first_seen = max(num_computed_tokens - window + 1, 0)
            droppable = min(first_seen // self.block_size, len(table))
            for index in range(done[group], droppable):
                freed += self._to_placeholder(table, index)
            dropped[group] = max(done[group], droppable)
        if any(dropped):
            self._num_dropped[request_id] = dropped
        return freed

    def _to_placeholder(self, table: list[int], index: int) -> int:
        """Put the placeholder at table[index], freeing the block there; 1 if a block went back."""
        block = table[index]
        if self._placeholder is None:  # the first block dropped becomes the placeholder itself
            self._placeholder = block
            self.pool.share(block)
            return 0
        if block == self._placeholder:
            return 0
        self.pool.share(self._placeholder)
        self.pool.free([block])
        table[index] = self._placeholder
        return 1

    def free(self, request_id: str) -> None:
        self._num_registered.pop(request_id, None)
        if (awaited := self._awaiting.pop(request_id, None)) is not None:
            self._unpin(awaited)
        self._num_dropped.pop(request_id, None)
        for table in self.block_tables.pop(request_id, []):
            self.pool.free(table)
        if self._placeholder is not None and not self._num_dropped:
            self.pool.free([self._placeholder])  # no table uses it any more
            self._placeholder = None

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self.block_tables[request_id][group]

    def tables_of(self, request_id: str) -> Tables:
        """Every group's block table of the request."""
        return self.block_tables[request_id]
