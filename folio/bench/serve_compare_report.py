"""What `folio bench serve-compare` shows and keeps: both servers side by side per rate with the ratio
folio/peer, one JSON (both full results, the ratios, each server's command line), and PNG plots (latency
CDFs of both servers; with several rates, throughput and p99 TTFT against the rate, a line per server)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from folio.bench.serve_compare_types import CompareReport
from folio.bench.serve_metrics import hit_rate
from folio.bench.serve_report import _pyplot
from folio.bench.serve_stats import dump_json, format_rate
from folio.bench.serve_types import RateResult
from folio.results import save_figure, write_text_atomic

# (id in the JSON, label in the table, where in a rate's summary, which way is better)
METRICS = (
    ("requests_per_s", "requests/s", ("requests_per_s",), "higher"),
    ("output_tokens_per_s", "output tok/s", ("output_tokens_per_s",), "higher"),
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
)
SERVER_COLORS = ("#3b6ea8", "#c9822b", "#4f9a55")


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
    if all(hit_rate(result.summary) is None for run in report.runs for result in run.report.results):
        skip.add("prefix_cache_hit_rate")
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


def _cell(value: Any, width: int = 12) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, str):
        return f"{value:>{width}}"
    return f"{value:>{width}.2f}"


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
    for row, mine, peer in zip(ratios(report), ours.report.results, theirs.report.results, strict=True):
        lines.append("")
        lines.append(f"{'rate ' + row['request_rate'] + ' req/s':<20}{_cell(ours.name, column)}"
                     f"{_cell(theirs.name, column)}{_cell(ratio_name, width)}  better")  # fmt: skip
        done = [f"{r.summary['completed']}/{r.summary['num_requests']}" for r in (mine, peer)]
        lines.append(f"{'completed':<20}{_cell(done[0], column)}{_cell(done[1], column)}")
        for key, label, _, better in _shown(report):
            m = row["metrics"][key]
            shown = None if m["ratio"] is None else f"{m['ratio']:.2f}x"
            values = _cell(m[ours.name], column) + _cell(m[theirs.name], column)
            lines.append(f"{label:<20}{values}{_cell(shown, width)}  {better}")
    if w.slo:
        slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in w.slo.items())
        lines.append(f"goodput: requests/s meeting every SLO ({slo})")
    return "\n".join(lines)


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
    plt = _pyplot()
    index = plotted_rate_index(report.config.workload.request_rates)
    panels = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end latency"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.9))
    for ax, (key, name) in zip(axes, panels, strict=True):
        for run, color in zip(report.runs, SERVER_COLORS, strict=False):
            records = run.report.results[index].records
            values = [getattr(r, key) for r in records if r.success and getattr(r, key) is not None]
            if values:
                ms = np.sort(np.asarray(values) * 1000)
                ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", color=color, label=run.name)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xlim(left=0)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{name} CDF (left is better)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rate = format_rate(report.config.workload.request_rates[index])
    fig.suptitle(_title(report, f"rate {rate} req/s"), fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_rates(report: CompareReport, path: Path) -> None:
    """Output tok/s and p99 TTFT per rate, one line per server; rates sit at evenly spaced ticks so inf fits."""
    plt = _pyplot()
    rates = report.config.workload.request_rates
    order = sorted(range(len(rates)), key=lambda i: rates[i])
    x = np.arange(len(order))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.9))
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
    fig.suptitle(_title(report, "each rate in turn"), fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
