"""What `folio bench spec` shows and keeps: every cell's speedup over its baseline, the table (one block per
workload, a row per setting and configuration), the bars of the speculative-decoding issue as pass/fail
lines (reported, never asserted), and the JSON; the plot is spec_plot.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from folio_tools.bench.harness.table import percent, row
from folio_tools.bench.serve.stats import dump_json
from folio_tools.bench.spec.plot import plot_speedups
from folio_tools.bench.spec.values import OFFLINE, Cell, SpecReport
from folio_tools.bench.spec.workloads import GROUNDED
from folio_tools.results import result_paths, write_text_atomic

PROMPT_LOOKUP = ("ngram", "suffix")  # methods held to 2x on the grounded workload at batch 1
COLUMNS = ("tok/s", "TPOT mean", "TPOT p50", "TPOT p99", "TTFT p50", "accept", "acc len", "speedup", "decode", "same",
           "MFU %", "MBU %")  # fmt: skip
WIDTHS = [9, 10, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7]


def add_speedups(cells: list[Cell]) -> None:
    """Each cell's output tok/s over its baseline's (same engine, workload and setting), prefill included as
    users wait for it, and its decoding alone (the baseline's mean TPOT over its own); None when the baseline
    did not run there or the values are missing."""
    index = {(c.engine, c.variant, c.workload, c.setting): c for c in cells}
    for cell in cells:
        base = index.get((cell.engine, cell.baseline, cell.workload, cell.setting))
        ok = base is not None and base.output_tokens_per_s > 0
        cell.speedup = cell.output_tokens_per_s / base.output_tokens_per_s if ok else None
        mine, theirs = _ms(cell.tpot_ms, "mean"), _ms(base.tpot_ms, "mean") if base is not None else None
        cell.decode_speedup = theirs / mine if mine and theirs else None


def bars(report: SpecReport) -> list[dict[str, Any]]:
    """The issue's bars: at batch 1 on the grounded workload, prompt lookup (ngram, suffix) at least 2x
    without speculation; a draft model at least 2x its target alone, at batch 1 on every workload; on chat
    at concurrency 16, every method at least 0.95x. A bar whose cell did not run is listed, not judged."""
    c = report.config
    index = {(cell.variant, cell.workload, cell.setting): cell for cell in report.cells if cell.engine == "folio"}
    wanted = []
    for v in (v for v in c.variants if v.name != v.baseline):
        if v.method in PROMPT_LOOKUP and GROUNDED in c.workloads:
            wanted.append((v.name, GROUNDED, OFFLINE, 2.0, f"{v.name} >= 2x {v.baseline} at batch 1 on {GROUNDED}"))
        if v.method == "draft":
            wanted += [(v.name, w, OFFLINE, 2.0, f"{v.name} >= 2x {v.baseline} (its target alone) at batch 1 on {w}")
                       for w in c.workloads]  # fmt: skip
        if "chat" in c.workloads:
            wanted.append((v.name, "chat", "c16", 0.95, f"{v.name} >= 0.95x {v.baseline} on chat at concurrency 16"))
    found = []
    for variant, workload, setting, bar, text in wanted:
        cell = index.get((variant, workload, setting))
        speedup = cell.speedup if cell is not None else None
        passed = None if speedup is None else speedup >= bar
        decode = cell.decode_speedup if cell is not None else None
        found.append({"bar": text, "threshold": bar, "speedup": speedup, "decode_speedup": decode, "passed": passed})
    return found


def _times(ratio: float | None) -> str | None:
    return None if ratio is None else f"{ratio:.2f}x"


def _bar_value(bar: dict[str, Any]) -> str:
    if bar["speedup"] is None:
        return "not measured"
    decode = f" (decoding alone {bar['decode_speedup']:.2f}x)" if bar["decode_speedup"] is not None else ""
    return f"{bar['speedup']:.2f}x{decode}"


def _ms(stats: dict[str, float] | None, key: str) -> float | None:
    return stats.get(key) if stats else None


def _cells_row(cell: Cell) -> str:
    spec = cell.spec
    same = None if cell.matches_baseline is None else f"{cell.matches_baseline}/{cell.num_requests}"
    values = [
        cell.output_tokens_per_s, _ms(cell.tpot_ms, "mean"), _ms(cell.tpot_ms, "p50"), _ms(cell.tpot_ms, "p99"),
        _ms(cell.ttft_ms, "p50"), spec.acceptance_rate if spec else None, spec.mean_accepted_length if spec else None,
        _times(cell.speedup), _times(cell.decode_speedup), same, percent(cell.mfu), percent(cell.mbu),
    ]  # fmt: skip
    label = f"{cell.setting:<7}{'' if cell.engine == 'folio' else cell.engine + ' '}{cell.variant}"
    return row(label, values, label_width=30, widths=WIDTHS)


def format_table(report: SpecReport) -> str:
    c = report.config
    lines = [
        f"speculative decoding: {c.model}, {c.num_prompts} requests per workload, max {c.max_tokens} tokens, "
        f"seed {c.seed}, {'EOS ignored' if c.ignore_eos else 'stopping at EOS'}",
        "batch1: in process, one request at a time; cN: served, N in flight. Times in ms; accept: drafts "
        "accepted / drafted; acc len: tokens per verification; speedup: tok/s over the baseline's; decode: its "
        "TPOT over this one's; same: "
        "answers equal to the baseline's; MFU, MBU: see below",
    ]
    for workload in c.workloads:
        lines += ["", row(f"{workload}", list(COLUMNS), label_width=30, widths=WIDTHS)]
        lines += [_cells_row(cell) for cell in report.cells if cell.workload == workload]
    lines += ["", utilisation_note(report)]
    verdicts = bars(report)
    if verdicts:
        lines.append("")
    for bar in verdicts:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[bar["passed"]]
        lines.append(f"{verdict}  {bar['bar']}: {_bar_value(bar)}")
    return "\n".join(lines)


def utilisation_note(report: SpecReport) -> str:
    """What the MFU and MBU columns are measured against, and what they count."""
    peaks = report.peaks
    against = (f"peaks measured at the start: {peaks['matmul_gflops']:.0f} GFLOP/s ({peaks['dtype']} GEMM), "
               f"{peaks['read_gbps']:.1f} GB/s read" if peaks else "no peaks measured")  # fmt: skip
    return (f"MFU: the requests' FLOPs over the wall time; MBU (batch1): output tok/s x the target's weight and KV "
            f"bytes of a batch-1 step;\n{against}; with speculation both are effective (output tokens counted once), "
            "so MBU can pass 100%")  # fmt: skip


def _markdown_cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_markdown(report: SpecReport) -> str:
    """The table again as Markdown, one table per workload, and the bars: for docs/benchmarks.md."""
    c = report.config
    lines = [f"`{report.command}` ({report.date_utc}, {report.machine['cpu']}, {report.machine['cores']} cores)"]
    head = ["setting", "engine", "variant", "output tok/s", "TPOT mean ms", "TPOT p50 ms", "TPOT p99 ms",
            "TTFT p50 ms", "acceptance", "accepted length", "speedup", "decode speedup", "MFU %", "MBU %"]  # fmt: skip
    for workload in c.workloads:
        lines += ["", f"**{workload}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for cell in (cell for cell in report.cells if cell.workload == workload):
            spec = cell.spec
            values = [
                cell.setting, cell.engine, cell.variant, _markdown_cell(cell.output_tokens_per_s),
                *(_markdown_cell(_ms(cell.tpot_ms, key)) for key in ("mean", "p50", "p99")),
                _markdown_cell(_ms(cell.ttft_ms, "p50")),
                _markdown_cell(spec.acceptance_rate if spec else None, 2),
                _markdown_cell(spec.mean_accepted_length if spec else None, 2),
                "-" if cell.speedup is None else f"**{cell.speedup:.2f}x**", _times(cell.decode_speedup) or "-",
                percent(cell.mfu) or "-", percent(cell.mbu) or "-",
            ]  # fmt: skip
            lines.append("| " + " | ".join(values) + " |")
    lines += ["", utilisation_note(report)]
    verdicts = bars(report)
    if verdicts:
        lines.append("")
    for bar in verdicts:
        verdict = {True: "pass", False: "FAIL", None: "n/a"}[bar["passed"]]
        lines.append(f"- {verdict}: {bar['bar']}: {_bar_value(bar)}")
    return "\n".join(lines) + "\n"


def to_dict(report: SpecReport) -> dict[str, Any]:
    c = report.config
    return {
        "benchmark": "spec",
        "command": report.command,
        "date_utc": report.date_utc,
        "machine": report.machine,
        "model": c.model,
        "settings": c.settings(),
        "variants": [v.to_dict() for v in c.variants],
        "peer_variants": [{"name": v.name, "method": v.method, "args": list(v.args)} for v in c.peer_variants],
        "servers": report.servers,
        "load_s": report.loads,
        "speedup": "output tok/s over the baseline variant's, same engine, workload and setting (prefill included); "
        "decode_speedup: the baseline's mean TPOT over this one's; the bars are judged on speedup",
        "bars": bars(report),
        "peaks": report.peaks,
        "utilisation": "mfu: the completed requests' FLOPs (prompt and output tokens) over the wall time, over the "
        "peaks' matmul rate; mbu (batch1 only): output tok/s x (the weight bytes a greedy step of the target "
        "reads + the mean context's KV bytes), over the peaks' read rate; both fractions, effective for "
        "speculation (output tokens counted once; drafts and rejected verifications not counted), so mbu can "
        "pass 1",
        "results": [cell.to_dict() for cell in report.cells],
    }


def write_report(report: SpecReport, output_dir: Path) -> list[Path]:
    """`spec_<model>_<stamp>` + `.json`, `.md` and `.png` in `output_dir`."""
    json_path, png_path = result_paths(output_dir, "spec", report.config.model, report.date_utc)
    markdown_path = json_path.with_name(json_path.stem + ".md")
    write_text_atomic(json_path, dump_json(to_dict(report)))
    write_text_atomic(markdown_path, format_markdown(report))
    plot_speedups(report, png_path)
    return [json_path, markdown_path, png_path]
