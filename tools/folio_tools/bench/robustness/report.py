"""Tables and plots of the robustness benchmarks (`folio bench fuzz`, `folio bench overload`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from folio_tools.bench.harness.plots import figure
from folio_tools.bench.robustness.fuzz import FuzzReport
from folio_tools.bench.robustness.overload import OverloadReport
from folio_tools.results import write_json


def _state_line(state: dict) -> str:
    keys = ("admitted", "running", "waiting", "kv_cache_usage")
    values = ", ".join(f"{key} {state.get(key)}" for key in keys)
    return f"after the run: {'healthy' if state.get('healthy') else 'NOT healthy'}; {values}"


def format_fuzz(report: FuzzReport) -> str:
    lines = [f"{report.requests} cases in {report.elapsed_s:.0f} s against {report.base_url}"]
    lines += [f"  {operation:<28} " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
              for operation, statuses in sorted(report.by_operation.items())]  # fmt: skip
    if report.by_shape:
        lines.append("hostile shapes:")
        lines += [f"  {shape:<28} " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
                  for shape, statuses in sorted(report.by_shape.items())]  # fmt: skip
    lines.append(f"failures (5xx, unformatted 4xx, accepted hostile shapes, stream errors, no answer): "
                 f"{report.failures}")  # fmt: skip
    lines += [f"  {s['operation']}: {s['problem']}: {s['answer'][:200]}" for s in report.samples[:5]]
    lines.append(_state_line(report.final_state))
    lines.append("PASSED" if report.passed else "FAILED")
    return "\n".join(lines)


def format_overload(report: OverloadReport) -> str:
    config = report.config
    lines = [f"{report.requests} requests from {config.concurrency} clients over {report.elapsed_s:.0f} s: "
             + ", ".join(f"{s}: {n}" for s, n in report.by_status.items())]  # fmt: skip
    lines.append(f"failures (not 200/429, stream errors, no answer): {report.failures}")
    lines += [f"  {sample}" for sample in report.samples[:5]]
    if (memory := report.memory_summary()) is not None:
        warm, peak, end = memory["warm"], memory["peak"], memory["end"]
        lines.append(f"server RSS: {warm:.0f} MiB warm, {peak:.0f} peak, {end:.0f} at the end")
    lines.append(_state_line(report.final_state))
    lines.append("PASSED" if report.passed else "FAILED")
    return "\n".join(lines)


def write_fuzz(report: FuzzReport, json_path: Path, png_path: Path) -> None:
    write_json(json_path, report.to_dict())
    operations = sorted(report.by_operation)
    statuses = sorted({s for counts in report.by_operation.values() for s in counts})
    with figure(png_path, figsize=(8, 3.8)) as (_, ax):
        _stacked_statuses(ax, report, operations, statuses)


def _stacked_statuses(ax: Any, report: FuzzReport, operations: list[str], statuses: list[str]) -> None:
    left = [0] * len(operations)
    for status in statuses:
        widths = [report.by_operation[op].get(status, 0) for op in operations]
        ax.barh(operations, widths, left=left, label=status)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("cases")
    ax.legend(title="status", fontsize=8)
    hostile = sum(sum(counts.values()) for counts in report.by_shape.values())
    ax.set_title(f"schemathesis and {hostile} hostile shapes: {report.requests} cases, {report.failures} failures",
                 fontsize=10)  # fmt: skip


def write_overload(report: OverloadReport, json_path: Path, png_path: Path) -> None:
    write_json(json_path, report.to_dict())
    with figure(png_path, figsize=(7, 3.6)) as (_, ax):
        if report.memory_mib:
            ax.plot([t for t, _ in report.memory_mib], [m for _, m in report.memory_mib])
        ax.set_xlabel("seconds")
        ax.set_ylabel("server RSS (MiB)")
        statuses = ", ".join(f"{s}: {n}" for s, n in report.by_status.items())
        ax.set_title(f"{report.config.concurrency} clients: {statuses}; {report.failures} failures", fontsize=9)
