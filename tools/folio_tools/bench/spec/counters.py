"""Speculative decoding's counters as `folio bench spec` reads them, from wherever an engine keeps them:
folio's in-process `Scheduler.spec_stats`, folio serve's Prometheus `/metrics` (vLLM's names under `folio:`),
or the `timings` llama-server sends with each response (`draft_n`, `draft_n_accepted`; it has no count of
verifications, so no mean accepted length). A run's counts are the difference of two readings."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from folio.spec_decode.scheduling import SpecDecodeStats
from folio_tools.bench.serve.client import request_headers

_METRICS = {  # /metrics counter (without the namespace and `_total`) -> field
    "spec_decode_num_drafts": "num_drafts",
    "spec_decode_num_draft_tokens": "num_draft_tokens",
    "spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounts:
    num_drafts: int | None  # verifications; None where the engine does not count them (llama-server)
    num_draft_tokens: int
    num_accepted_tokens: int
    source: str  # "engine" (in process), "/metrics" or "llama.cpp timings"
    # [j]: drafts accepted at position j (vLLM's per-position counter); empty where not counted (llama-server)
    accepted_per_position: tuple[int, ...] = ()

    def since(self, before: SpecCounts) -> SpecCounts:
        """What was counted between the reading `before` and this one."""
        drafts = None if self.num_drafts is None or before.num_drafts is None else self.num_drafts - before.num_drafts
        earlier = before.accepted_per_position
        per_position = tuple(
            n - (earlier[j] if j < len(earlier) else 0) for j, n in enumerate(self.accepted_per_position)
        )
        return SpecCounts(drafts, self.num_draft_tokens - before.num_draft_tokens,
                          self.num_accepted_tokens - before.num_accepted_tokens, self.source, per_position)  # fmt: skip

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens gained per verification: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length}  # fmt: skip


def from_engine(stats: SpecDecodeStats) -> SpecCounts:
    """A reading of an in-process engine's counters (`llm.engine.make_stats().spec_decoding`)."""
    return SpecCounts(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, "engine",
                      tuple(stats.accepted_per_position))  # fmt: skip


def parse_metrics(text: str) -> SpecCounts | None:
    """The spec-decode counters of a Prometheus text exposition, summed over their label sets; None unless
    all three are there."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            namespace, _, name = sample.name.removesuffix("_total").partition(":")
            if namespace in ("folio", "vllm") and name in _METRICS:
                sums[_METRICS[name]] = sums.get(_METRICS[name], 0.0) + sample.value
            elif namespace in ("folio", "vllm") and name == _PER_POSITION and "position" in sample.labels:
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
    if len(sums) != len(_METRICS):
        return None
    positions = tuple(round(per_position.get(j, 0.0)) for j in range(max(per_position, default=-1) + 1))
    return SpecCounts(round(sums["num_drafts"]), round(sums["num_draft_tokens"]),
                      round(sums["num_accepted_tokens"]), "/metrics", positions)  # fmt: skip


def scrape_metrics(base_url: str, timeout_s: float = 10.0) -> SpecCounts | None:
    """The server's counters now; None when it has no /metrics or no spec-decode counters there."""
    import httpx

    try:
        response = httpx.get(f"{base_url}/metrics", headers=request_headers(), timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


def from_llama_timings(timings: Iterable[dict[str, Any] | None]) -> SpecCounts:
    """The drafts of a run's llama-server responses, summed from the `timings` each one ended with
    (llama-server leaves `draft_n` out of a response it drafted nothing for)."""
    drafted = accepted = 0
    for timing in timings:
        if timing:
            drafted += int(timing.get("draft_n", 0))
            accepted += int(timing.get("draft_n_accepted", 0))
    return SpecCounts(None, drafted, accepted, "llama.cpp timings")
