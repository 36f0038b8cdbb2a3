"""What `folio bench serve` takes and gives: the workload's settings, each rate's result and the report;
kept apart from the runner so the report writers never import it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.serve.client import (
    check_extra_body,
    normalize_base_url,
)
from folio_tools.bench.serve.stats import RequestRecord, format_rate
from folio_tools.bench.serve.workload import CHAT_DATASETS


@dataclass
class ServeConfig:
    base_url: str
    model: str
    input_len_range: LengthRange
    output_len_range: LengthRange
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    max_concurrency: int | None = None
    slo: dict[str, float] = field(default_factory=dict)  # seconds
    price_per_hour: float | None = None
    seed: int = 0
    tokenizer: str | None = None
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    use_tqdm: bool = True
    turns: int = 4  # multi-turn: user turns per conversation
    document_len: int = 2000  # document, tenants: tokens of the shared document (of each tenant's)
    tenants: int = 4  # tenants: documents, each shared by its tenant's requests
    probe_request: bool = True  # send one short request before timing (a static-batching server holds it)
    metrics_lag_s: float = 0.0  # wait this long before reading /metrics, for a server whose counters lag
    # multi-turn, agent: the assistant turns of a history are the dataset's answers ("dataset", the same
    # prompts for every server) or the server's own replies to the earlier turns ("replies", as a chat client)
    history: str = "dataset"

    def __post_init__(self) -> None:
        self.base_url = normalize_base_url(self.base_url)
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if self.history not in ("dataset", "replies"):
            raise ValueError(f"--history must be dataset or replies, got {self.history!r}")
        if self.turns < 1:
            raise ValueError(f"--turns must be at least 1, got {self.turns}")
        if self.document_len < 1:
            raise ValueError(f"--document-len must be at least 1, got {self.document_len}")
        if self.tenants < 1:
            raise ValueError(f"--tenants must be at least 1, got {self.tenants}")
        if not self.metrics_lag_s >= 0:  # also refuses nan
            raise ValueError(f"--metrics-lag must not be negative, got {self.metrics_lag_s}")
        for rate in self.request_rates:
            if not rate > 0:  # also refuses nan
                raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if self.price_per_hour is not None and not self.price_per_hour >= 0:
            raise ValueError(f"--price-per-hour must not be negative, got {self.price_per_hour}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout_s}")
        check_extra_body(self.extra_body)

    @property
    def chat(self) -> bool:
        return self.dataset in CHAT_DATASETS

    def size_text(self) -> str:
        """How much one rate sends: `100 requests`, or `20 conversations x 4 turns`."""
        if self.dataset in ("multi-turn", "agent"):
            return f"{self.num_prompts} conversations x {self.turns} turns"
        return f"{self.num_prompts} requests"


@dataclass
class RateResult:
    request_rate: float
    summary: dict[str, Any]
    records: list[RequestRecord]

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_rate": format_rate(self.request_rate),
            **self.summary,
            "requests": [r.to_dict() for r in self.records],
        }


@dataclass
class ServeReport:
    command: str
    date_utc: str
    config: ServeConfig
    label: str
    tokenizer: str
    server: dict[str, Any]
    workload: dict[str, Any]
    results: list[RateResult]
    machine: dict[str, Any]
    peaks: dict[str, Any] | None = None  # roofline.MachinePeaks, measured before the first rate

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        undrawn = c.dataset in ("humaneval", "document", "tenants")  # prompts not drawn to --input-len-range
        return {
            "benchmark": "serve",
            "command": self.command,
            "date_utc": self.date_utc,
            "machine": self.machine,
            "peaks": self.peaks,
            "label": self.label,
            "base_url": c.base_url,
            "model": c.model,
            "tokenizer": self.tokenizer,
            "endpoint": "/v1/chat/completions" if c.chat else "/v1/completions",
            "server": self.server,
            "dataset": c.dataset,
            "seed": c.seed,
            "num_prompts": c.num_prompts,
            "settings": {
                "request_rates": [format_rate(r) for r in c.request_rates],
                "max_concurrency": c.max_concurrency,
                "slo_ms": {key: value * 1000 for key, value in c.slo.items()},
                "price_per_hour": c.price_per_hour,
                "input_len_range": None if undrawn else str(c.input_len_range),
                "turns": c.turns if c.dataset in ("multi-turn", "agent") else None,
                "history": c.history if c.dataset in ("multi-turn", "agent") else None,
                "document_len": c.document_len if c.dataset in ("document", "tenants", "agent") else None,
                "tenants": c.tenants if c.dataset == "tenants" else None,
                "output_len_range": str(c.output_len_range),
                "dataset_path": c.dataset_path,
                "timeout_s": c.timeout_s,
                "extra_body": c.extra_body,
                "metrics_lag_s": c.metrics_lag_s,
            },
            "workload": self.workload,
            "results": [r.to_dict() for r in self.results],
        }
