"""The KV tiers under an engine's block pool, attached and kept in step: the host-RAM tier
(`--kv-offload-ram`) and the disk tier (`--kv-cache-dir`, `--kv-cache-disk`).

Each tier has a scheduler's half (kv_cache/host_tier.py, kv_cache/disk_tier.py: which key is where)
and a runner's half (worker/host_tier_store.py, worker/disk_tier_store.py: the bytes and files). After
every step `sync_tiers` hands the runner what the step's results asked for (the disk saves of blocks it
just computed), and hands the scheduler what the runner's I/O thread finished (reads from disk).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from folio.config import ModelConfig
from folio.kv_cache.disk_tier import DiskTier
from folio.kv_cache.host_tier import HostTier
from folio.kv_cache.manager import KVCacheManager
from folio.worker.disk_tier_store import DiskTierStore
from folio.worker.host_tier_store import HostTierStore, block_bytes
from folio.worker.kv_files import kv_fingerprint, model_digest
from folio.worker.model_runner import ModelRunner

logger = logging.getLogger("folio")

DEFAULT_DISK_BYTES = 20 << 30  # or half the file system's free space, if less
STAGING_BYTES = 1 << 30  # at most, for the RAM tier a disk tier stages its reads in when none was asked for
STALE_TEMPORARY_SECONDS = 600  # a temporary file this old was left by a writer that died


def attach_host_tier(kv: KVCacheManager, runner: ModelRunner, ram: int) -> None:
    """A host-RAM tier of `ram` bytes under the block pool."""
    per_block = block_bytes(runner.kv_caches, runner.slots_per_block)
    num_slots = ram // per_block
    if num_slots < 1:
        raise ValueError(f"--kv-offload-ram of {ram} bytes holds no KV block ({per_block} bytes)")
    kv.attach_tier(HostTier(num_slots))
    runner.host_tier = HostTierStore(runner.kv_caches, num_slots, runner.slots_per_block)
    logger.info("KV host tier: %d blocks (%.1f MiB of RAM) keep the prefix-cache blocks the pool evicts",
                num_slots, num_slots * per_block / 2**20)  # fmt: skip


def attach_disk_tier(kv: KVCacheManager, runner: ModelRunner, directory: Path, disk_bytes: int | None,
                     model_path: Path, settings: dict[str, object], max_model_len: int) -> None:  # fmt: skip
    """A disk tier in a subdirectory of `directory` named by the KV's fingerprint (the model's files and
    `settings`), within `disk_bytes` (default: 20 GiB or half the free space, whichever is less). A
    directory that cannot be written leaves the engine without a disk tier, with a warning."""
    layout = [(str(t.dtype), tuple(t.shape[1:])) for layer in runner.kv_caches for t in layer.tensors()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        digest = model_digest(model_path, directory / "model-digests.json")
        fingerprint = kv_fingerprint(digest, {**settings, "block_size": kv.block_size, "layout": layout})
        folder = directory / fingerprint.hex()[:16]
        folder.mkdir(exist_ok=True)
        probe = folder / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        logger.warning("KV disk tier off: cannot use %s (%s)", directory, error.strerror or error)
        return
    _remove_stale_temporaries(folder)
    # The disk's reads are staged in the RAM tier: it holds at least one longest prompt's blocks.
    per_block = block_bytes(runner.kv_caches, runner.slots_per_block)
    staging = min(-(-max_model_len // kv.block_size), max(STAGING_BYTES // per_block, 1))
    if kv.tier is None or kv.tier.num_slots < staging:
        if kv.tier is not None:
            logger.info("KV host tier: grown to stage the disk tier's reads")
        attach_host_tier(kv, runner, staging * per_block)
    assert runner.host_tier is not None and kv.tier is not None
    per_file = runner.host_tier.slot_bytes + 4096  # with its header, roughly
    budget = disk_bytes if disk_bytes is not None else min(DEFAULT_DISK_BYTES, shutil.disk_usage(folder).free // 2)
    if budget // per_file < 1:
        raise ValueError(f"--kv-cache-disk of {budget} bytes holds no KV block ({per_file} bytes)")
    disk = DiskTier(kv.tier, folder, budget // per_file)
    kv.attach_disk(disk)
    runner.disk_tier = DiskTierStore(runner.host_tier, folder, fingerprint)
    logger.info("KV disk tier: %s holds up to %d blocks (%.1f GiB); %d found from before", folder,
                disk.capacity, budget / 2**30, disk.num_files)  # fmt: skip


def fingerprint_settings(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str, quantization: str,
                         activation_bits: int) -> dict[str, object]:  # fmt: skip
    """What besides the model's files and the tokens decides a block's KV."""
    return {"config": repr(config), "dtype": str(dtype), "kv_cache_dtype": kv_cache_dtype,
            "quantization": quantization, "activation_bits": activation_bits, "ranks": 1}  # fmt: skip


def sync_tiers(kv: KVCacheManager, runner: ModelRunner, idle: bool) -> bool:
    """After a step: the runner saves what the step computed; the scheduler learns which disk reads
    ended. An idle step (every waiting request waits for the disk) waits a little for one to end.
    Returns whether a read ended: a request waiting for it may be admitted now."""
    runner.run_tier_ops(kv.take_tier_ops())
    store, disk = runner.disk_tier, kv.disk
    if store is None or disk is None:
        return False
    if store.disabled is not None and disk.enabled:
        disk.disable()
    if idle and disk.loading:
        store.wait(0.01)
    ended = store.finished()
    kv.finish_disk_reads(ended)
    disk.io = replace(store.counters)
    return bool(ended)


def _remove_stale_temporaries(folder: Path) -> None:
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    for path in folder.glob(".*.tmp"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
        except OSError:
            pass
