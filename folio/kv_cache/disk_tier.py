"""The disk tier under the host-RAM tier (`--kv-cache-dir`, `--kv-cache-disk`): prefix-cache blocks kept
as files, so that they outlive memory pressure and restarts.

This is the scheduler's half: which keys have a file in this model's directory, least recently used
first, within the budget. Every block is written when the prefix cache registers it (write-through:
a restart, even after a crash, finds what was computed), and each file is named by its key's digest.
A request whose next blocks miss in the pool and the RAM tier but have files waits while the runner's
I/O thread reads them into reserved RAM-tier slots; the batch goes on without it. When the reads
report back, it is admitted and loads those blocks from the RAM tier like any other hit. A read that
finds the file gone, torn, or another model's is a miss: the request computes those blocks.

Two servers may share a directory: each file is written under a temporary name and renamed, a key
missing from the index is looked for on disk before it counts as a miss, and the directory is scanned
again now and then, so the files another server wrote count against the budget too.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from folio.kv_cache.block_pool import CacheKey
from folio.kv_cache.hashing import BlockKey
from folio.kv_cache.host_tier import HostTier
from folio.kv_cache.tier_ops import DiskCounters, DiskLoad, DiskSave

FILE_SUFFIX = ".kv"


def file_name(digest: bytes) -> str:
    return digest.hex() + FILE_SUFFIX


class DiskTier:
    def __init__(self, host: HostTier, directory: Path, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"a disk tier needs room for at least one block, got {capacity_blocks}")
        self.host = host
        self.directory = directory
        self.capacity = capacity_blocks
        self._files: OrderedDict[bytes, None] = OrderedDict()  # digests with a file, least recently used first
        self._loading: dict[int, CacheKey] = {}  # reserved RAM-tier slot -> the key its read brings
        self._saves_since_scan = 0
        self._saves: list[DiskSave] = []  # for the runner, since the last take_ops
        self._loads: list[DiskLoad] = []
        self._removes: list[bytes] = []
        self.enabled = True
        self.num_stored = 0  # blocks written
        self.num_loaded = 0  # blocks read back into the RAM tier
        self.num_failed = 0  # reads that found no usable file
        self.io = DiskCounters()  # the runner's reading of its I/O, as of the last step
        self.rescan()

    @property
    def num_files(self) -> int:
        return len(self._files)

    @property
    def loading(self) -> frozenset[CacheKey]:
        """Keys whose files are being read."""
        return frozenset(self._loading.values())

    def rescan(self) -> None:
        """Take in the files of the directory that the index lacks (left by an earlier run, or written by
        another server), as least recently used by their modification time, then keep to the budget."""
        try:
            entries = sorted((e.stat().st_mtime_ns, e.name) for e in os.scandir(self.directory)
                             if e.name.endswith(FILE_SUFFIX))  # fmt: skip
        except OSError:  # the directory went away: files are looked for again as keys are
            return
        found = []
        for _, name in entries:
            try:
                digest = bytes.fromhex(name.removesuffix(FILE_SUFFIX))
            except ValueError:
                continue
            if digest not in self._files:
                found.append(digest)
        self._files = OrderedDict.fromkeys([*found, *self._files])
        self._trim()

    def save(self, block: int, key: CacheKey) -> None:
        """Pool block `block` holds `key`'s computed KV: write it, unless a file has it already."""
        if not self.enabled:
            return
        digest = key[1].digest
        if digest in self._files:
            self._files.move_to_end(digest)
            return
        self._files[digest] = None
        if digest in self._removes:  # pushed out and written again in one step: the write goes first
            self._removes.remove(digest)
        self._saves.append(DiskSave(block, key[1]))
        self.num_stored += 1
        self._saves_since_scan += 1
        if self._saves_since_scan >= max(self.capacity // 8, 16):
            self._saves_since_scan = 0
            self.rescan()
        else:
            self._trim()

    def prefetch(self, keys: Sequence[BlockKey]) -> set[CacheKey]:
        """`keys` follow a request's hits in the pool: of the leading ones that the RAM tier holds or
        that have files, pin the first and start reading the others, while the RAM tier has slots that are
        not pinned. Returns the keys pinned or on their way."""
        waiting: set[CacheKey] = set()
        loading = self.loading
        for key in keys:
            cache_key = (0, key)
            if cache_key in loading:
                waiting.add(cache_key)
                continue
            if cache_key in self.host:  # pinned, or reading the next keys could push it out
                self.host.pin([cache_key])
                waiting.add(cache_key)
                continue
            if not self.enabled or not self._has_file(key.digest):
                break
            slot = self.host.reserve_slot()
            if slot is None:
                break
            self._loading[slot] = cache_key
            self._files.move_to_end(key.digest)
            self._loads.append(DiskLoad(slot, key))
            waiting.add(cache_key)
        return waiting

    def take_ops(self) -> tuple[tuple[DiskSave, ...], tuple[DiskLoad, ...], tuple[bytes, ...]]:
        """The saves, reads and removals asked for since the last call."""
        ops = tuple(self._saves), tuple(self._loads), tuple(self._removes)
        self._saves, self._loads, self._removes = [], [], []
        return ops

    def finish(self, results: Sequence[tuple[int, bool]]) -> list[CacheKey]:
        """The runner's reads that ended: (slot, whether the slot now holds the block). Returns the keys
        the RAM tier now holds."""
        filled = []
        for slot, ok in results:
            key = self._loading.pop(slot)
            if ok:
                self.host.fill(slot, key)
                filled.append(key)
                self.num_loaded += 1
            else:
                self.host.release(slot)
                self._files.pop(key[1].digest, None)
                self.num_failed += 1
        return filled

    def disable(self) -> None:
        """The runner could not write (disk full, directory read-only): no disk tier from here on."""
        self.enabled = False
        self._files.clear()

    def _has_file(self, digest: bytes) -> bool:
        if digest in self._files:
            return True
        if not (self.directory / file_name(digest)).is_file():
            return False
        self._files[digest] = None  # another server wrote it
        self._trim()
        return True

    def _trim(self) -> None:
        while len(self._files) > self.capacity:
            digest, _ = self._files.popitem(last=False)
            self._removes.append(digest)
