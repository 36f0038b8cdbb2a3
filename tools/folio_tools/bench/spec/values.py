"""What `folio bench spec` takes and gives: the configurations it compares (`Variant`), one measurement of
one configuration on one workload at one concurrency (`Cell`), and the report; kept apart from the runners
so that the report writers never import them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from folio.engine_args import EngineArgs
from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.spec.counters import SpecCounts

OFFLINE = "batch1"  # the setting of the in-process runs: one request at a time


@dataclass(frozen=True)
class Variant:
    """One folio configuration: a speculative method ("none": without speculation) with the engine flags
    it runs under, and the variant its speedup is measured against (itself for a baseline)."""

    name: str
    method: str
    baseline: str
    engine_args: EngineArgs

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "method": self.method, "baseline": self.baseline,
                "flags": self.engine_args.to_cli_flags()}  # fmt: skip


@dataclass(frozen=True)
class PeerVariant:
    """One llama-server configuration: its speculation flags (none for the baseline)."""

    name: str
    method: str
    args: tuple[str, ...]


@dataclass
class SpecConfig:
    model: str
    variants: list[Variant]
    workloads: list[str]
    num_prompts: int = 32
    max_tokens: int = 256
    input_len_range: LengthRange = field(default_factory=lambda: LengthRange(16, 1024))
    seed: int = 0
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    offline: bool = True
    served: bool = True
    peer: str = "llama.cpp"  # or "none"
    peer_variants: list[PeerVariant] = field(default_factory=list)
    ignore_eos: bool = False  # False: each answer ends where the model ends it, as users see it
    llama_threads: int = 2
    timeout_s: float = 600.0
    dataset_path: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("--num-prompts and --max-tokens must be at least 1")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency needs levels of at least 1, got {self.concurrency}")
        if not (self.offline or self.served or self.peer != "none"):
            raise ValueError("nothing to run: --no-offline and --no-served with --peer none")

    def settings(self) -> dict[str, Any]:
        return {
            "workloads": self.workloads,
            "num_prompts": self.num_prompts,
            "max_tokens": self.max_tokens,
            "input_len_range": str(self.input_len_range),
            "seed": self.seed,
            "concurrency": self.concurrency,
            "offline": self.offline,
            "served": self.served,
            "peer": self.peer,
            "ignore_eos": self.ignore_eos,
            "llama_threads": self.llama_threads,
            "timeout_s": self.timeout_s,
            "dataset_path": self.dataset_path,
        }


@dataclass
class Cell:
    """One configuration on one workload at one setting: `batch1` (in process, one request at a time) or
    `c<N>` (served, N requests in flight).

    `mfu` and `mbu` are fractions of the machine's peaks measured as the run started (roofline.py); MFU is
    the requests' FLOPs (prompt and output tokens, as `TokenCost.request_flops` counts them) over the wall
    time, MBU (batch 1 only) output tok/s x a batch-1 decode step's bytes (the weights a greedy step of
    the target reads, `LoadedModel.step_weight_bytes`, and the mean context's KV). With speculation both
    are effective utilisation: an output token counts once, and drafting, the draft model's weights and
    rejected verifications are not counted as useful work, so MBU can pass 100% when one read of the
    weights verifies several tokens."""

    engine: str  # "folio" or "llama.cpp"
    variant: str
    method: str
    baseline: str
    workload: str
    setting: str
    concurrency: int
    num_requests: int
    completed: int
    output_tokens: int
    duration_s: float  # batch1: the requests' summed wall time; served: the run's
    tpot_ms: dict[str, float] | None  # mean, p50, p99, ... over requests
    ttft_ms: dict[str, float] | None
    spec: SpecCounts | None  # None without speculation, or when the engine did not report it
    matches_baseline: int | None = None  # batch1: answers token for token the same as the baseline's
    speedup: float | None = None  # output tok/s over the baseline's at the same workload and setting
    decode_speedup: float | None = None  # the baseline's mean TPOT over this one's: decoding alone
    mfu: float | None = None
    mbu: float | None = None  # batch1 cells only: a served step's batch is unknown

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        cell = asdict(self)
        cell["spec"] = self.spec.to_dict() if self.spec is not None else None
        return {**cell, "output_tokens_per_s": self.output_tokens_per_s}


@dataclass
class SpecReport:
    command: str
    date_utc: str
    config: SpecConfig
    machine: dict[str, Any]
    cells: list[Cell]
    servers: list[dict[str, str]]  # name and the exact command line of every server started
    loads: dict[str, float]  # batch1: seconds each variant took to load
    peaks: dict[str, Any] = field(default_factory=dict)  # roofline.MachinePeaks, measured before the first run
