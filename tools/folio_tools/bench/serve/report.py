"""What `folio bench serve` shows and keeps: a table per rate, the JSON record, and PNG plots (latency
CDFs; throughput and p99 TTFT against the request rate when several rates ran)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from folio_tools.bench.harness.plots import FOLIO_COLOR, PEER_COLOR, cdf_axes, figure, latency_cdf
from folio_tools.bench.harness.table import row
from folio_tools.bench.serve.stats import dump_json, format_rate
from folio_tools.bench.serve.values import ServeReport
from folio_tools.results import write_text_atomic

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
TABLE_STATS = ("mean", "p50", "p90", "p99")
LATENCY_PANELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end latency"))


def format_table(report: ServeReport) -> str:
    results = report.results
    sources = "/".join(sorted({r.summary["output_tokens_source"] for r in results} - {None})) or "-"
    c = report.config
    head = (
        f"{report.label}: {c.dataset}{_dataset_detail(report)}, {c.size_text()}, seed {c.seed}, "
        f"max concurrency {c.max_concurrency or 'none'}, output tokens from {sources}"
    )
    lines = [head, row("request rate", [format_rate(r.request_rate) for r in results])]
    lines.append(row("completed", [f"{r.summary['completed']}/{r.summary['num_requests']}" for r in results]))
    lines.append(row("duration s", [r.summary["duration_s"] for r in results]))
    lines.append(row("requests/s", [r.summary["requests_per_s"] for r in results]))
    if report.config.slo:
        lines.append(row("goodput req/s", [r.summary["goodput_requests_per_s"] for r in results]))
    lines.append(row("output tok/s", [r.summary["output_tokens_per_s"] for r in results]))
    lines.append(row("total tok/s", [r.summary["total_tokens_per_s"] for r in results]))
    lines.append(row("MFU %", [_percent_of(r.summary.get("mfu")) for r in results]))
    if report.config.price_per_hour is not None:
        lines.append(row("$/1M output tok", [r.summary["cost_per_1m_output_tokens"] for r in results]))
    caches = [r.summary.get("prefix_cache") for r in results]
    if any(isinstance(cache, dict) for cache in caches):
        lines.append(row("prefix query tok", [_count(cache, "queried_tokens") for cache in caches]))
        lines.append(row("prefix hit tok", [_count(cache, "hit_tokens") for cache in caches]))
        lines.append(row("prefix hit rate", [_percent(cache) for cache in caches]))
    tiers = [r.summary.get("kv_tiers") or {} for r in results]
    if any(tiers):  # folio with --kv-offload-ram or --kv-cache-dir
        lines.append(row("RAM-tier hit blocks", [t.get("ram_loaded_blocks", 0) for t in tiers]))
        lines.append(row("disk-tier hit blocks", [t.get("disk_loaded_blocks", 0) for t in tiers]))
        lines.append(row("disk write MB", [t.get("disk_written_bytes", 0) / 2**20 for t in tiers]))
        lines.append(row("disk ms/block read", [t.get("disk_load_ms_per_block") for t in tiers]))
    for key, name in LATENCIES:
        for stat in TABLE_STATS:
            lines.append(row(f"{stat} {name} ms", [(r.summary[key] or {}).get(stat) for r in results]))
    if report.config.slo:
        slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in report.config.slo.items())
        lines.append(f"goodput: requests/s meeting every SLO ({slo})")
    if report.peaks:
        lines.append(f"MFU: the requests' FLOPs over the machine's {report.peaks['matmul_gflops']:.0f} GFLOP/s "
                     f"({report.peaks['dtype']} GEMM, measured at the start)")  # fmt: skip
    if not any(isinstance(cache, dict) for cache in caches):
        lines.append("prefix cache: not reported (the server has no prefix_cache_* counters at /metrics)")
    return "\n".join(lines)


def _percent_of(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def _dataset_detail(report: ServeReport) -> str:
    if "document_tokens" in report.workload:
        return f" (a {report.workload['document_tokens']}-token document)"
    return ""


def _count(cache: Any, key: str) -> str | None:
    return str(cache[key]) if isinstance(cache, dict) else None


def _percent(cache: Any) -> str | None:
    rate = cache.get("hit_rate") if isinstance(cache, dict) else None
    return None if rate is None else f"{rate:.1%}"


def file_stem(report: ServeReport) -> str:
    stamp = report.date_utc.replace("-", "").replace(":", "")  # 2025-01-31T12:00:00Z -> 20250131T120000Z
    name = Path(report.label).name.removesuffix(".gguf")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "server"
    return f"serve-{label}-{stamp}"


def write_report(report: ServeReport, output_dir: Path) -> list[Path]:
    """`<stem>.json`, `<stem>-latency.png` and, with several rates, `<stem>-rates.png`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = file_stem(report)
    json_path = output_dir / f"{stem}.json"
    write_text_atomic(json_path, dump_json(report.to_dict()))
    paths = [json_path, output_dir / f"{stem}-latency.png"]
    plot_latency_cdfs(report, paths[1])
    if len(report.results) > 1:
        paths.append(output_dir / f"{stem}-rates.png")
        plot_rates(report, paths[2])
    return paths


def _title(report: ServeReport) -> str:
    c = report.config
    cap = f", at most {c.max_concurrency} in flight" if c.max_concurrency else ""
    return (
        f"{report.label} at {c.base_url}, {c.dataset}, {c.size_text()}{cap}\n"
        f"client: {report.machine['cpu']} ({report.machine['cores']} cores)"
    )


def plot_latency_cdfs(report: ServeReport, path: Path) -> None:
    with figure(path, len(LATENCY_PANELS), (4.2 * len(LATENCY_PANELS), 3.8), _title(report)) as (_, axes):
        for ax, (key, name) in zip(axes, LATENCY_PANELS, strict=True):
            for result in report.results:
                values = [getattr(r, key) for r in result.records if r.success and getattr(r, key) is not None]
                latency_cdf(ax, values, label=format_rate(result.request_rate))
            cdf_axes(ax, name, f"{name} CDF")
            ax.legend(title="req/s", fontsize=7, title_fontsize=7)


def plot_rates(report: ServeReport, path: Path) -> None:
    """Throughput and p99 TTFT per request rate; rates sit at evenly spaced ticks so that inf fits."""
    with figure(path, 2, (9, 3.8), _title(report)) as (_, (left, right)):
        _plot_rate_panels(report, left, right)


def _plot_rate_panels(report: ServeReport, left: Any, right: Any) -> None:
    results = sorted(report.results, key=lambda r: r.request_rate)
    labels = [format_rate(r.request_rate) for r in results]
    x = np.arange(len(labels))
    output = [r.summary["output_tokens_per_s"] for r in results]
    requests = [r.summary["requests_per_s"] for r in results]
    left.plot(x, output, "o-", color=FOLIO_COLOR, label="output tok/s")
    left.set_ylabel("output tokens/s")
    twin = left.twinx()
    twin.plot(x, requests, "s--", color=PEER_COLOR, label="requests/s")
    if report.config.slo:
        goodput = [r.summary["goodput_requests_per_s"] for r in results]
        twin.plot(x, goodput, "^:", color="#4f9a55", label="goodput req/s")
    twin.set_ylabel("requests/s")
    left.set_title("throughput", fontsize=9)
    handles = left.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], fontsize=7)
    p99 = [(r.summary["ttft_ms"] or {}).get("p99", np.nan) for r in results]
    right.plot(x, p99, "o-", color="#a83b3b")
    if "ttft" in report.config.slo:
        right.axhline(report.config.slo["ttft"] * 1000, color="gray", linestyle="--", label="TTFT SLO")
        right.legend(fontsize=7)
    right.set_ylabel("p99 TTFT (ms)")
    right.set_title("p99 time to first token", fontsize=9)
    for ax in (left, twin, right):
        ax.set_ylim(bottom=0)
    for ax in (left, right):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
