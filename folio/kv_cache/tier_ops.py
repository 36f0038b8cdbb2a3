"""What the KV tiers under the block pool ask the runner to do, as values (`TierOps`).

The scheduler's halves of the tiers (host_tier.py, disk_tier.py) decide which key goes where; the
runner's halves (worker/host_tier_store.py, worker/disk_tier_store.py) carry it out, in an order that
keeps every byte right: first the disk saves (a block's bytes as the last forward left them, before a
copy from the RAM tier may write into the block), then the copies between pool and RAM tier in the
order they were asked for, then the disk reads (into RAM-tier slots no copy touches while reserved)
and removals. Disk reads and writes run on the runner's I/O thread; a read reports back when its slot
holds the block, or that the file was unusable.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.kv_cache.hashing import BlockKey


@dataclass(frozen=True)
class TierCopy:
    """One batch of copies between the pool and the host-RAM tier, all in one direction: pool block
    `blocks[i]` to host slot `slots[i]` (a save) or back (a load). No slot appears twice in a batch."""

    load: bool
    blocks: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class DiskSave:
    """Write pool block `block`, whose computed KV is `key`'s, to the disk tier (its bytes are taken
    at once; the file is written in the background)."""

    block: int
    key: BlockKey


@dataclass(frozen=True)
class DiskLoad:
    """Read `key`'s file into host slot `slot` in the background, checking it first."""

    slot: int
    key: BlockKey


@dataclass(frozen=True)
class TierOps:
    """One batch of the tiers' work, carried out in the order of its fields."""

    disk_saves: tuple[DiskSave, ...] = ()
    copies: tuple[TierCopy, ...] = ()
    disk_loads: tuple[DiskLoad, ...] = ()
    disk_removes: tuple[bytes, ...] = ()  # digests of keys whose files the disk budget pushed out

    def __bool__(self) -> bool:
        return bool(self.disk_saves or self.copies or self.disk_loads or self.disk_removes)


@dataclass
class DiskCounters:
    """The disk tier's I/O since it started, as the runner's I/O thread counts it."""

    bytes_written: int = 0
    bytes_read: int = 0
    save_seconds: float = 0.0
    load_seconds: float = 0.0
    dropped_saves: int = 0  # not written: the disk fell behind by more than the store lets wait
    refused_files: int = 0  # torn, corrupted or foreign files found and deleted
