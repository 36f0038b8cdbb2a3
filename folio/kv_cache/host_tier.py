"""The host-RAM tier under the block pool (`--kv-offload-ram`): where prefix-cache blocks go when the
pool evicts them, and where a later request's prefix finds them again instead of recomputing them.

This is the scheduler's half: which cache key sits in which of the tier's slots, least recently used
first out. It never touches KV bytes. What must move is written down as `TierCopy` batches (tier_ops.py),
in order, and sent to the runner with the step (the runner's half, worker/host_tier_store.py, holds the slots' bytes):
a block's KV is saved before the step writes into the block again, and loaded before the forward that
reads it. A key being loaded is pinned: the saves made room for in the same step never evict it.

Under a disk tier (disk_tier.py), the tier also stages the blocks read back from disk: a slot is
reserved while its file is being read, and holds the key once the read succeeded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from folio.kv_cache.block_pool import CacheKey
from folio.kv_cache.tier_ops import TierCopy


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[CacheKey, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[CacheKey] = set()
        self._ops: list[TierCopy] = []
        self.num_stored = 0  # blocks saved into the tier
        self.num_loaded = 0  # blocks loaded back into the pool

    @property
    def num_used(self) -> int:
        return len(self._slots)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._slots

    def store(self, block: int, key: CacheKey) -> None:
        """The pool is handing `block` (computed KV of `key`) out for something else: keep a copy, making
        room by dropping the least recently used key that is not pinned; if every key is pinned, the copy
        is not kept (a later request recomputes the block)."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._slots[key] = slot
        self._add(False, block, slot)
        self.num_stored += 1

    def load(self, key: CacheKey, block: int) -> None:
        """Copy `key`'s KV into pool block `block` before the next forward."""
        slot = self._slots[key]
        self._slots.move_to_end(key)
        self._add(True, block, slot)
        self.num_loaded += 1

    def pin(self, keys: Iterable[CacheKey]) -> None:
        self._pinned.update(keys)

    def unpin(self, keys: Iterable[CacheKey]) -> None:
        self._pinned.difference_update(keys)

    def take_ops(self) -> tuple[TierCopy, ...]:
        ops, self._ops = tuple(self._ops), []
        return ops

    def reserve_slot(self) -> int | None:
        """A slot for a block on its way from disk, out of the LRU until `fill` or `release`; None if
        every key is pinned."""
        return self._take_slot()

    def fill(self, slot: int, key: CacheKey) -> None:
        """The reserved `slot` now holds `key`'s block (most recently used)."""
        if key in self._slots:  # saved again meanwhile: keep that copy
            self.release(slot)
            return
        self._slots[key] = slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((key for key in self._slots if key not in self._pinned), None)
        return None if victim is None else self._slots.pop(victim)

    def _add(self, load: bool, block: int, slot: int) -> None:
        last = self._ops[-1] if self._ops else None
        if last is not None and last.load == load and slot not in last.slots:
            self._ops[-1] = TierCopy(load, (*last.blocks, block), (*last.slots, slot))
        else:
            self._ops.append(TierCopy(load, (block,), (slot,)))
