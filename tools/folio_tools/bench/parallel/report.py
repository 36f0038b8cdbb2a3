"""`folio bench parallel`'s table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from folio_tools.bench.harness.plots import engine_bars, figure
from folio_tools.bench.harness.table import row


def format_table(report: dict[str, Any]) -> str:
    batch = report["batch"]
    titles = ["b1 tok/s", "x tp1", "b1 MBU", "b1 comm ms", "b1 comm KiB", "b1 step ms", f"b{batch} tok/s", "x tp1",
              "MFU", "comm ms", "comm KiB", "step ms"]  # fmt: skip
    keys = ["batch1_decode_tok_s", "batch1_ratio", "batch1_mbu", "comm_ms_per_step_batch1",
            "comm_kib_per_step_batch1", "step_ms_batch1", "batch_output_tok_s", "batch_ratio", "batch_mfu",
            "comm_ms_per_step_batch", "comm_kib_per_step_batch", "step_ms_batch"]  # fmt: skip
    if report.get("long_prompt_tokens"):
        titles += ["long tok/s", "x tp1", "long MFU", "long comm ms"]
        keys += ["long_prefill_tok_s", "long_prefill_ratio", "long_prefill_mfu", "comm_ms_per_step_long"]
    lines = [row("engine", titles, widths=11)]
    for name, engine in report["engines"].items():
        lines.append(row(name, [engine["median"].get(key) for key in keys], widths=11))
    peaks = report.get("peaks")
    if peaks:
        lines.append(f"peaks measured at the start: {peaks['matmul_gflops']:.0f} GFLOP/s ({peaks['dtype']} GEMM), "
                     f"{peaks['read_gbps']:.1f} GB/s read")  # fmt: skip
    return "\n".join(lines)


def write_plot(path: Path, report: dict[str, Any]) -> None:
    names = list(report["engines"])
    medians = [report["engines"][n]["median"] for n in names]
    colors = ["#4c72b0"] * len(names)
    long = bool(report.get("long_prompt_tokens"))
    with figure(path, ncols=3 if long else 2, title=f"{report['model']}: whole vs split, same cores") as (_, axes):
        engine_bars(axes[0], names, [m["batch1_decode_tok_s"] for m in medians], colors, "batch 1 decode tok/s")
        engine_bars(axes[1], names, [m["batch_output_tok_s"] for m in medians], colors,
                    f"batch {report['batch']} output tok/s")  # fmt: skip
        if long:
            engine_bars(axes[2], names, [m["long_prefill_tok_s"] for m in medians], colors,
                        f"{report['long_prompt_tokens']}-token prompt: prefill tok/s")  # fmt: skip
