"""`SchedulerStats`: one reading of the scheduler's counters and gauges, as a value (vLLM's name).

/metrics, the Ray replicas' load reports and the benchmarks read this instead of reaching into the
scheduler and the KV cache: the scheduler's fields and the block pool stay its own business, and a
reading never changes under its reader while the engine steps on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from folio.spec_decode.scheduling import SpecDecodeStats
from folio.structured.grammar import MaskTiming


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int  # requests given tokens in steps (live beams included)
    num_waiting: int  # requests queued for admission, preempted ones among them
    num_preemptions: int  # since the engine started
    kv_usage_ratio: float  # KV blocks in use over all blocks
    kv_capacity_tokens: int  # tokens the KV cache holds when every block is in use
    spec_decoding: SpecDecodeStats  # drafts verified and accepted, since the engine started
    mask_timing: MaskTiming  # structured output's token masks: how many, and their time

    @classmethod
    def reading(cls, running: int, waiting: int, preemptions: int, kv_usage: float, kv_capacity: int,
                spec: SpecDecodeStats, masks: MaskTiming) -> SchedulerStats:  # fmt: skip
        """Copies of the live counters, so the value stays as read."""
        spec = replace(spec, accepted_per_position=list(spec.accepted_per_position))
        return cls(running, waiting, preemptions, kv_usage, kv_capacity, spec, replace(masks))
