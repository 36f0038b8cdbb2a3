"""`folio bench parallel`'s table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from folio.bench.plots import engine_bars, figure
from folio.bench.table import row


def format_table(report: dict[str, Any]) -> str:
    batch = report["batch"]
    lines = [row("engine", ["b1 tok/s", "x tp1", "b1 comm ms", "b1 comm KiB", "b1 step ms", f"b{batch} tok/s",
                            "x tp1", "comm ms", "comm KiB", "step ms"], widths=11)]  # fmt: skip
    for name, engine in report["engines"].items():
        m = engine["median"]
        keys = ["batch1_decode_tok_s", "batch1_ratio", "comm_ms_per_step_batch1", "comm_kib_per_step_batch1",
                "step_ms_batch1", "batch_output_tok_s", "batch_ratio", "comm_ms_per_step_batch",
                "comm_kib_per_step_batch", "step_ms_batch"]  # fmt: skip
        values = [m[key] for key in keys]
        lines.append(row(name, values, widths=11))
    return "\n".join(lines)


def write_plot(path: Path, report: dict[str, Any]) -> None:
    names = list(report["engines"])
    medians = [report["engines"][n]["median"] for n in names]
    colors = ["#4c72b0"] * len(names)
    with figure(path, ncols=2, title=f"{report['model']}: whole vs split, same cores") as (_, axes):
        engine_bars(axes[0], names, [m["batch1_decode_tok_s"] for m in medians], colors, "batch 1 decode tok/s")
        engine_bars(axes[1], names, [m["batch_output_tok_s"] for m in medians], colors,
                    f"batch {report['batch']} output tok/s")  # fmt: skip
