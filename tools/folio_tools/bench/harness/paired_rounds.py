"""Two engines measured in alternating rounds, for a ratio a drifting machine does not skew.

On a shared 2-core machine the memory's speed moves by 15-27% within minutes (docs/benchmarks.md), so
folio's batch-1 rate measured first and llama-bench's measured minutes later can disagree by more than
what sets them apart. `alternate` runs one measurement of each in turn, round after round: each
round's two figures share the machine's state, and the median of the rounds' ratios is the comparison.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PairedRounds:
    first: list[float]  # one rate per round, measured first in it
    second: list[float]

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.first, self.second, strict=True)]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    def to_dict(self) -> dict[str, object]:
        return {"first": self.first, "second": self.second, "ratios": self.ratios, "median_ratio": self.median_ratio}


def alternate(measure_first: Callable[[], float], measure_second: Callable[[], float], rounds: int) -> PairedRounds:
    """`rounds` rounds of measure_first() then measure_second() (each a rate, higher is faster)."""
    if rounds < 1:
        raise ValueError(f"paired rounds must be at least 1, got {rounds}")
    first: list[float] = []
    second: list[float] = []
    for _ in range(rounds):
        first.append(measure_first())
        second.append(measure_second())
    return PairedRounds(first, second)
