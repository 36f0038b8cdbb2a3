"""The one plotting helper of the benchmarks: a figure that is titled, laid out and saved atomically as a
PNG when its block ends, per-engine bars, and latency CDFs. matplotlib is slow to import, so it is
imported when a figure is made, never when a benchmark module is."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from folio_tools.results import save_figure

FOLIO_COLOR, PEER_COLOR = "#3b6ea8", "#c9822b"
SERVER_COLORS = (FOLIO_COLOR, PEER_COLOR, "#4f9a55")  # one per server, in run order


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install -e ./tools") from None
    return plt


@contextmanager
def figure(path: Path, ncols: int = 1, figsize: tuple[float, float] = (8, 3.8), title: str | None = None,
           title_size: float = 9) -> Iterator[tuple[Any, Any]]:  # fmt: skip
    """`(fig, axes)` of one row of `ncols` panels (`axes` a single Axes when 1), written to `path` when the
    block ends."""
    plt = pyplot()
    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    try:
        yield fig, axes
        if title is not None:
            fig.suptitle(title, fontsize=title_size)
        fig.tight_layout()
        save_figure(fig, path)
    finally:
        plt.close(fig)


def engine_colors(engines: Sequence[str], peer: str | None = None) -> list[str]:
    """folio's color for folio's bars, the peer's for the others (or only for `peer`, when given)."""
    return [PEER_COLOR if (e == peer if peer else e != "folio") else FOLIO_COLOR for e in engines]


def engine_bars(ax: Any, engines: Sequence[str], values: Sequence[float | None], colors: Sequence[str],
                title: str, label_size: float | None = None) -> None:  # fmt: skip
    """One labelled bar per engine that has a value."""
    shown = [(e, v, c) for e, v, c in zip(engines, values, colors, strict=True) if v is not None]
    bars = ax.bar([e for e, _, _ in shown], [v for _, v, _ in shown], color=[c for _, _, c in shown])
    ax.bar_label(bars, fmt="%.1f", fontsize=label_size)
    ax.set_title(title, fontsize=9)
    ax.margins(y=0.15)


def grouped_engine_bars(ax: Any, groups: Sequence[str], values: dict[str, Sequence[float]], fmt: str,
                        ylabel: str) -> None:  # fmt: skip
    """Per group (an x tick), one labelled bar per engine side by side: `values[engine][i]` for groups[i],
    folio in its color and the others in the peer's."""
    engines = list(values)
    width = 0.8 / len(engines)
    for k, engine in enumerate(engines):
        xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, values[engine], width, color=FOLIO_COLOR if engine == "folio" else PEER_COLOR,
                      label=engine)  # fmt: skip
        ax.bar_label(bars, fmt=fmt, fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)


def latency_cdf(ax: Any, seconds: Sequence[float], **style: Any) -> None:
    """The empirical CDF of latencies, in milliseconds; nothing for no values."""
    if len(seconds):
        ms = np.sort(np.asarray(seconds) * 1000)
        ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", **style)


def cdf_axes(ax: Any, name: str, title: str) -> None:
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
