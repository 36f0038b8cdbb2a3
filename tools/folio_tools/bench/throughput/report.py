"""`folio bench throughput` results: per-engine metrics, the side-by-side table, and the JSON + PNG."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from folio_tools.bench.harness.plots import engine_bars, engine_colors, figure
from folio_tools.bench.harness.table import row
from folio_tools.results import machine_info, write_json

METRICS = (  # (key, label) of what is compared across engines
    ("requests_per_s", "requests/s"),
    ("output_tokens_per_s", "output tok/s"),
    ("total_tokens_per_s", "total tok/s"),
    ("mfu_percent", "MFU %"),
    ("elapsed_s", "elapsed s"),
    ("load_s", "load s"),
)


@dataclass
class EngineResult:
    """One engine's timed run over the whole workload (load time measured apart from it)."""

    engine: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # tokens the requests asked for; the throughput numerator
    generated_tokens: int  # tokens actually decoded, including a static batch's surplus
    elapsed_s: float
    load_s: float
    threads: int
    # The workload's FLOPs (the same for every engine) per second, over the peak measured as the run
    # started (folio_tools/bench/harness/roofline.py).
    mfu: float | None = None
    preemptions: int | None = None  # folio's: requests whose KV blocks were taken back to make room

    @property
    def mfu_percent(self) -> float | None:
        return None if self.mfu is None else 100 * self.mfu

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "mfu": self.mfu,
        }


@dataclass
class ThroughputReport:
    command: str
    date_utc: str
    model: str
    model_path: str
    dtype: str
    dataset: str
    seed: int
    num_prompts: int
    settings: dict[str, Any]
    results: list[EngineResult]
    machine: dict[str, Any] = field(default_factory=machine_info)
    peaks: dict[str, Any] = field(default_factory=dict)  # MachinePeaks, measured as the run started

    @property
    def ratios(self) -> dict[str, float]:
        """folio over the peer for the throughput metrics; empty without a peer."""
        by_engine = {r.engine: r for r in self.results}
        folio, peer = by_engine.get("folio"), by_engine.get(self.peer_name)
        if folio is None or peer is None:
            return {}
        return {
            "output_tokens_per_s": folio.output_tokens_per_s / peer.output_tokens_per_s,
            "total_tokens_per_s": folio.total_tokens_per_s / peer.total_tokens_per_s,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "throughput",
            "command": self.command,
            "date_utc": self.date_utc,
            "machine": self.machine,
            "model": self.model,
            "model_path": self.model_path,
            "dtype": self.dtype,
            "dataset": self.dataset,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "settings": self.settings,
            "peaks": self.peaks,
            "results": {r.engine: r.to_dict() for r in self.results},
            "ratios": {f"folio/{self.peer_name}": self.ratios} if self.ratios else {},
        }

    @property
    def peer_name(self) -> str:
        return next((r.engine for r in self.results if r.engine != "folio"), "")


def format_table(report: ThroughputReport) -> str:
    engines = [r.engine for r in report.results]
    ratios = report.ratios
    ratio_head = f"folio/{report.peer_name}" if ratios else ""
    lines = [row("", engines + ([ratio_head] if ratios else []), label_width=14)]
    for key, label in METRICS:
        values = [getattr(r, key) for r in report.results] + ([ratios[key]] if key in ratios else [])
        lines.append(row(label, values, label_width=14))
    counts = ", ".join(f"{r.engine} {r.output_tokens} useful / {r.generated_tokens} decoded" for r in report.results)
    lines.append(f"output tokens: {counts}")
    pool = report.settings.get("kv_pool")
    if pool:
        preempted = next((r.preemptions for r in report.results if r.preemptions is not None), None)
        lines.append(
            f"folio KV pool: {pool['blocks']} blocks in {pool['block_tables']} block table(s) a request, "
            f"{pool['tokens']} tokens with every block kept; {preempted} preemptions"
        )
    return "\n".join(lines)


def file_stem(report: ThroughputReport) -> str:
    stamp = report.date_utc.replace("-", "").replace(":", "")  # 2025-01-31T12:00:00Z -> 20250131T120000Z
    name = Path(report.model).name.removesuffix(".gguf")  # a catalog name, or a file/folder path
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"
    return f"throughput_{model}_{report.dataset}_{stamp}"


def write_report(report: ThroughputReport, output_dir: Path) -> tuple[Path, Path]:
    """Write `<stem>.json` and `<stem>.png` into `output_dir`; returns both paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = file_stem(report)
    json_path, png_path = output_dir / f"{stem}.json", output_dir / f"{stem}.png"
    write_json(json_path, report.to_dict())
    plot_report(report, png_path)
    return json_path, png_path


def plot_report(report: ThroughputReport, path: Path) -> None:
    panels = [("output_tokens_per_s", "output tokens/s"), ("total_tokens_per_s", "total tokens/s")]
    engines = [r.engine for r in report.results]
    title = (f"{Path(report.model).name} {report.dtype}, {report.dataset}, {report.num_prompts} requests\n"
             f"{report.machine['cpu']} ({report.machine['cores']} cores)")  # fmt: skip
    with figure(path, len(panels), (4.2 * len(panels), 3.8), title) as (_, axes):
        for ax, (key, label) in zip(axes, panels, strict=True):
            ratio = report.ratios.get(key)
            panel = label + (f"  (folio/{report.peer_name} = {ratio:.2f}x)" if ratio else "")
            engine_bars(ax, engines, [getattr(r, key) for r in report.results], engine_colors(engines), panel)
            ax.set_ylabel(label)
