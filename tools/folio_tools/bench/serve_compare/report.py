"""What `folio bench serve-compare` shows and keeps: both servers side by side per rate with the ratio
folio/peer, one JSON (both full results, the ratios, each server's command line), and PNG plots (latency
CDFs of both servers; with several rates, throughput and p99 TTFT against the rate, a line per server)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from folio_tools.bench.harness.plots import SERVER_COLORS, cdf_axes, figure, latency_cdf
from folio_tools.bench.harness.table import row as table_row
from folio_tools.bench.serve.metrics import hit_rate
from folio_tools.bench.serve.report import LATENCY_PANELS
from folio_tools.bench.serve.stats import dump_json, format_rate
from folio_tools.bench.serve.values import RateResult
from folio_tools.bench.serve_compare.values import CompareReport
from folio_tools.results import write_text_atomic

# (id in the JSON, label in the table, where in a rate's summary, which way is better)
METRICS = (
    ("requests_per_s", "requests/s", ("requests_per_s",), "higher"),
    ("output_tokens_per_s", "output tok/s", ("output_tokens_per_s",), "higher"),
    ("mfu", "MFU %", ("mfu",), "higher"),  # a fraction in the JSON
    ("goodput_requests_per_s", "goodput req/s", ("goodput_requests_per_s",), "higher"),
    ("cost_per_1m_output_tokens", "$/1M output tok", ("cost_per_1m_output_tokens",), "lower"),
    ("mean_ttft_ms", "mean TTFT ms", ("ttft_ms", "mean"), "lower"),
    ("p50_ttft_ms", "p50 TTFT ms", ("ttft_ms", "p50"), "lower"),
    ("p99_ttft_ms", "p99 TTFT ms", ("ttft_ms", "p99"), "lower"),
    ("mean_tpot_ms", "mean TPOT ms", ("tpot_ms", "mean"), "lower"),
    ("p99_tpot_ms", "p99 TPOT ms", ("tpot_ms", "p99"), "lower"),
    ("mean_itl_ms", "mean ITL ms", ("itl_ms", "mean"), "lower"),
    ("p99_e2e_ms", "p99 E2E ms", ("e2e_ms", "p99"), "lower"),
    ("prefix_cache_hit_rate", "prefix hit rate", ("prefix_cache", "hit_rate"), "higher"),
    ("kv_handover_ms", "KV hand-over ms", ("kv_transfer", "mean_ms"), "lower"),
    ("ram_tier_hit_blocks", "RAM-tier hit blocks", ("kv_tiers", "ram_loaded_blocks"), "higher"),
    ("disk_tier_hit_blocks", "disk-tier hit blocks", ("kv_tiers", "disk_loaded_blocks"), "higher"),
)


def metric_value(result: RateResult, where: tuple[str, ...]) -> float | None:
    value: Any = result.summary
    for key in where:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def _shown(report: CompareReport) -> list[tuple[str, str, tuple[str, ...], str]]:
    """The metrics this run has: goodput only with --slo, cost only with --price-per-hour, the prefix-cache hit
    rate only when a server reports it."""
    workload = report.config.workload
    skip = set()
    results = [result for run in report.runs for result in run.report.results]
    if all(hit_rate(result.summary) is None for result in results):
        skip.add("prefix_cache_hit_rate")
    if all(metric_value(result, ("mfu",)) is None for result in results):
        skip.add("mfu")  # a report written before MFU was measured
    if all(metric_value(result, ("kv_transfer", "mean_ms")) is None for result in results):
        skip.add("kv_handover_ms")
    for key, tier in (("ram_tier_hit_blocks", "ram_loaded_blocks"), ("disk_tier_hit_blocks", "disk_loaded_blocks")):
        if all(metric_value(result, ("kv_tiers", tier)) is None for result in results):
            skip.add(key)
    if not workload.slo:
        skip.add("goodput_requests_per_s")
    if workload.price_per_hour is None:
        skip.add("cost_per_1m_output_tokens")
    return [m for m in METRICS if m[0] not in skip]


def ratios(report: CompareReport) -> list[dict[str, Any]]:
    """Per rate and metric: each server's value and the ratio folio/peer (None where a value is missing)."""
    ours, theirs = report.runs
    rows = []
    for mine, peer in zip(ours.report.results, theirs.report.results, strict=True):
        metrics = {}
        for key, _, where, better in _shown(report):
            a, b = metric_value(mine, where), metric_value(peer, where)
            metrics[key] = {ours.name: a, theirs.name: b, "ratio": ratio(a, b), "better": better}
        rows.append({"request_rate": format_rate(mine.request_rate), "metrics": metrics})
    return rows


def to_dict(report: CompareReport) -> dict[str, Any]:
    ours, theirs = report.runs
    return {
        "benchmark": "serve-compare",
        "command": report.command,
        "date_utc": report.date_utc,
        "machine": report.machine,
        "model": report.config.model,
        "peer": report.config.peer,
        "ratio": f"{ours.name} / {theirs.name} per request rate; 'better' says which way is better",
        "ratios": ratios(report),
        "servers": [
            {"name": run.name, "command": run.command, "info": run.info, "result": run.report.to_dict()}
            for run in report.runs
        ],
    }


def format_table(report: CompareReport) -> str:
    ours, theirs = report.runs
    w = report.config.workload
    ratio_name = f"{ours.name}/{theirs.name}"
    width = max(16, len(ratio_name) + 2)
    column = max(12, len(ours.name) + 2, len(theirs.name) + 2)  # a server's column fits its name
    lines = [
        f"{ours.name} vs {theirs.name}: {report.config.model}, {w.dataset}, {w.size_text()}, seed {w.seed}, "
        f"max concurrency {w.max_concurrency or 'none'}",
        *(f"{run.name}: {run.command}" for run in report.runs),
    ]
    for rate, mine, peer in zip(ratios(report), ours.report.results, theirs.report.results, strict=True):
        lines.append("")
        widths = [column, column, width]
        heads = [ours.name, theirs.name, ratio_name]
        lines.append(table_row(f"rate {rate['request_rate']} req/s", heads, widths=widths) + "  better")
        done = [f"{r.summary['completed']}/{r.summary['num_requests']}" for r in (mine, peer)]
        lines.append(table_row("completed", done, widths=column))
        for key, label, _, better in _shown(report):
            m = rate["metrics"][key]
            shown = None if m["ratio"] is None else f"{m['ratio']:.2f}x"
            values = [_as_shown(key, m[ours.name]), _as_shown(key, m[theirs.name])]
            lines.append(table_row(label, [*values, shown], widths=widths) + f"  {better}")
    if w.slo:
        slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in w.slo.items())
        lines.append(f"goodput: requests/s meeting every SLO ({slo})")
    return "\n".join(lines)


def _as_shown(key: str, value: float | None) -> float | None:
    return value * 100 if key == "mfu" and value is not None else value


def file_stem(report: CompareReport) -> str:
    stamp = report.date_utc.replace("-", "").replace(":", "")  # 2025-01-31T12:00:00Z -> 20250131T120000Z
    name = Path(report.config.model).name.removesuffix(".gguf")
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "model"
    return f"serve-compare-{model}-{stamp}"


def write_report(report: CompareReport, output_dir: Path) -> list[Path]:
    """`<stem>.json`, `<stem>-latency.png` and, with several rates, `<stem>-rates.png`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = file_stem(report)
    json_path = output_dir / f"{stem}.json"
    write_text_atomic(json_path, dump_json(to_dict(report)))
    paths = [json_path, output_dir / f"{stem}-latency.png"]
    plot_latency_cdfs(report, paths[1])
    if len(report.config.workload.request_rates) > 1:
        paths.append(output_dir / f"{stem}-rates.png")
        plot_rates(report, paths[2])
    return paths


def plotted_rate_index(rates: list[float]) -> int:
    """The CDFs show one rate: the only one, else the highest finite one (the most loaded Poisson run)."""
    finite = [i for i, rate in enumerate(rates) if not math.isinf(rate)]
    return max(finite, key=lambda i: rates[i]) if finite else 0


def _title(report: CompareReport, what: str) -> str:
    w, m = report.config.workload, report.machine
    cap = f", at most {w.max_concurrency} in flight" if w.max_concurrency else ""
    names = " vs ".join(run.name for run in report.runs)
    return (
        f"{names}: {report.config.model}, {w.dataset}, {w.size_text()}{cap}, {what}\n"
        f"{m['cpu']} ({m['cores']} cores), one server at a time, {report.date_utc}"
    )


def plot_latency_cdfs(report: CompareReport, path: Path) -> None:
    index = plotted_rate_index(report.config.workload.request_rates)
    title = _title(report, f"rate {format_rate(report.config.workload.request_rates[index])} req/s")
    with figure(path, len(LATENCY_PANELS), (4.2 * len(LATENCY_PANELS), 3.9), title) as (_, axes):
        for ax, (key, name) in zip(axes, LATENCY_PANELS, strict=True):
            for run, color in zip(report.runs, SERVER_COLORS, strict=False):
                records = run.report.results[index].records
                values = [getattr(r, key) for r in records if r.success and getattr(r, key) is not None]
                latency_cdf(ax, values, color=color, label=run.name)
            cdf_axes(ax, name, f"{name} CDF (left is better)")
            ax.set_xlim(left=0)
            ax.legend(fontsize=7)


def plot_rates(report: CompareReport, path: Path) -> None:
    """Output tok/s and p99 TTFT per rate, one line per server; rates sit at evenly spaced ticks so inf fits."""
    with figure(path, 2, (9, 3.9), _title(report, "each rate in turn")) as (_, (left, right)):
        _plot_rate_panels(report, left, right)


def _plot_rate_panels(report: CompareReport, left: Any, right: Any) -> None:
    rates = report.config.workload.request_rates
    order = sorted(range(len(rates)), key=lambda i: rates[i])
    x = np.arange(len(order))
    for run, color in zip(report.runs, SERVER_COLORS, strict=False):
        results = [run.report.results[i] for i in order]
        left.plot(x, [r.summary["output_tokens_per_s"] for r in results], "o-", color=color, label=run.name)
        p99 = [(r.summary["ttft_ms"] or {}).get("p99", np.nan) for r in results]
        right.plot(x, p99, "o-", color=color, label=run.name)
    if "ttft" in report.config.workload.slo:
        right.axhline(report.config.workload.slo["ttft"] * 1000, color="gray", linestyle="--", label="TTFT SLO")
    left.set_ylabel("output tokens/s")
    left.set_title("throughput (higher is better)", fontsize=9)
    right.set_ylabel("p99 TTFT (ms)")
    right.set_title("p99 time to first token (lower is better)", fontsize=9)
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        ax.set_xticks(x, [format_rate(rates[i]) for i in order])
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
