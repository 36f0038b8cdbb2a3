"""The plot of `folio bench spec`: a panel per workload, a group of bars per setting (batch 1 in process,
then each served concurrency, then llama.cpp's), a bar per speculative configuration: its output tok/s
over its baseline's. 1x (no gain) and 2x (the issue's bar) are marked."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from folio_tools.bench.harness.plots import SERVER_COLORS, figure
from folio_tools.bench.spec.values import Cell, SpecReport

METHOD_COLORS = (*SERVER_COLORS, "#8e5ba8", "#c2453d", "#6b6b6b")


def _group(cell: Cell) -> str:
    return cell.setting if cell.engine == "folio" else f"{cell.engine} {cell.setting}"


def speedup_groups(cells: list[Cell]) -> tuple[list[str], list[str]]:
    """The groups (settings, in run order) and the bars (speculative variants, in run order) to plot."""
    shown = [c for c in cells if c.variant != c.baseline]
    groups = list(dict.fromkeys(_group(c) for c in shown))
    variants = list(dict.fromkeys(c.variant for c in shown))
    return groups, variants


def plot_speedups(report: SpecReport, path: Path) -> None:
    workloads = report.config.workloads
    groups, variants = speedup_groups(report.cells)
    m = report.machine
    title = (f"speculative decoding: {Path(report.config.model).name}, speedup over the baseline's output tok/s\n"
             f"{m['cpu']} ({m['cores']} cores), {report.date_utc}")  # fmt: skip
    width = max(4.5, 0.9 * len(groups) * max(1, len(variants)) / 2)
    with figure(path, len(workloads), (width * len(workloads), 4.0), title) as (_, axes):
        for ax, workload in zip(np.atleast_1d(axes), workloads, strict=True):
            cells = {(_group(c), c.variant): c for c in report.cells if c.workload == workload}
            x = np.arange(len(groups))
            step = 0.8 / max(1, len(variants))
            for i, variant in enumerate(variants):
                heights = [cells[(g, variant)].speedup if (g, variant) in cells else None for g in groups]
                xs = [x[j] + (i - (len(variants) - 1) / 2) * step for j, h in enumerate(heights) if h is not None]
                ys = [h for h in heights if h is not None]
                bars = ax.bar(xs, ys, step, color=METHOD_COLORS[i % len(METHOD_COLORS)], label=variant)
                ax.bar_label(bars, fmt="%.2f", fontsize=6)
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.axhline(2.0, color="gray", linewidth=0.8, linestyle="--")
            ax.set_xticks(x, groups, fontsize=7)
            ax.set_ylabel("speedup (x)")
            ax.set_title(workload, fontsize=9)
            ax.set_ylim(bottom=0)
            ax.margins(y=0.15)
            ax.legend(fontsize=7)
