"""The one table formatter of the benchmarks: fixed-width text rows, a left-aligned label then
right-aligned columns, so every benchmark prints (and the tests read) its results the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cell(value: Any, width: int = 12, number: str = ".2f") -> str:
    """A right-aligned column: "-" for a missing value, text as it is, a number formatted with `number`."""
    if value is None:
        value = "-"
    return f"{value:>{width}}" if isinstance(value, str) else f"{value:>{width}{number}}"


def row(label: str, values: Sequence[Any], label_width: int = 20, widths: int | Sequence[int] = 12,
        number: str = ".2f") -> str:  # fmt: skip
    """`label` padded to `label_width`, then one `cell` per value (`widths`: one for all, or one each)."""
    widths = [widths] * len(values) if isinstance(widths, int) else widths
    return f"{label:<{label_width}}" + "".join(cell(v, w, number) for v, w in zip(values, widths, strict=True))


def percent(fraction: float | None, unit: str = "") -> str | None:
    """A fraction (an MFU, an MBU) as a percentage with one decimal; None stays None (a "-" cell)."""
    return None if fraction is None else f"{100 * fraction:.1f}{unit}"
