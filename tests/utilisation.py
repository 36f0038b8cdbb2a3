"""MFU and MBU in tests. They are fractions of peaks measured when a bench run starts, and in the suite
the run shares the cores with the other xdist workers: a peak probed beside a busy neighbour reads low,
and a kernel can beat the GEMM probe outright, so a fraction above 1 says nothing about correctness (a
fresh clone's run failed on `mfu < 1`). What a test can check is the order of the figure: a unit slip
(GFLOP for FLOP, MiB for bytes) puts it off by 1e3 or more."""

from __future__ import annotations

import math

CEILING = 10.0  # far above any contended peak's share, far below a unit slip


def plausible(fraction: float | None) -> bool:
    return fraction is not None and math.isfinite(fraction) and 0 < fraction < CEILING
