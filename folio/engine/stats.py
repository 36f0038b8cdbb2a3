"""`SchedulerStats`: one reading of the scheduler's counters and gauges, as a value (vLLM's name).

/metrics, the Ray replicas' load reports and the benchmarks read this instead of reaching into the
scheduler and the KV cache: the scheduler's fields and the block pool stay its own business, and a
reading never changes under its reader while the engine steps on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from folio.kv_cache.tier_ops import DiskCounters
from folio.spec_decode.scheduling import SpecDecodeStats
from folio.structured.grammar import MaskTiming

if TYPE_CHECKING:  # read, never built, here
    from folio.engine.scheduler import Scheduler


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int  # requests given tokens in steps (live beams included)
    num_waiting: int  # requests queued for admission, preempted ones among them
    num_preemptions: int  # since the engine started
    kv_usage_ratio: float  # KV blocks in use over all blocks
    kv_capacity_tokens: int  # tokens the KV cache holds when every block is in use
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, since the engine started
    prefix_cache_hits: int  # of them, found there
    spec_decoding: SpecDecodeStats  # drafts verified and accepted, since the engine started
    mask_timing: MaskTiming  # structured output's token masks: how many, and their time
    tier: TierStats | None = None  # the host-RAM KV tier (--kv-offload-ram), if there is one
    disk: DiskStats | None = None  # the disk KV tier (--kv-cache-dir), if there is one


@dataclass(frozen=True)
class TierStats:
    capacity_blocks: int
    used_blocks: int
    stored_blocks: int  # evicted from the pool into the tier, since the engine started
    loaded_blocks: int  # loaded back into the pool for a prompt's prefix


@dataclass(frozen=True)
class DiskStats:
    capacity_blocks: int
    files: int
    stored_blocks: int  # written, since the engine started
    loaded_blocks: int  # read back into the RAM tier for a prompt's prefix
    failed_loads: int  # reads that found no usable file (removed, torn, corrupted, foreign)
    enabled: bool  # False once a write failed (disk full, read-only)
    io: DiskCounters  # bytes and seconds of the I/O thread, as of the last step


def read_stats(scheduler: Scheduler) -> SchedulerStats:
    """The scheduler's counters now; the live ones are copied, so the reading stays as read while the
    engine steps on."""
    kv, spec = scheduler.kv, scheduler.spec_stats
    return SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preemptions=scheduler.num_preemptions,
        kv_usage_ratio=kv.pool.usage_ratio,
        kv_capacity_tokens=kv.capacity_tokens,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        spec_decoding=replace(spec, accepted_per_position=list(spec.accepted_per_position)),
        mask_timing=replace(scheduler.structured.timing),
        tier=None
        if kv.tier is None
        else TierStats(kv.tier.num_slots, kv.tier.num_used, kv.tier.num_stored, kv.tier.num_loaded),  # fmt: skip
        disk=None
        if (d := kv.disk) is None
        else DiskStats(d.capacity, d.num_files, d.num_stored, d.num_loaded, d.num_failed, d.enabled, replace(d.io)),
    )
