"""The benchmark commands' machine peaks, measured once a session.

Every `folio bench` command measures the machine's matmul and read peaks as it starts (roofline.py); where
bfloat16 is emulated (AVX2, no AVX-512 BF16) its 1024^3 GEMM alone takes seconds, and `folio bench serve`
measures float32 and bfloat16 both. The benchmark tests share one real measurement per dtype instead: the
same function, on the same machine, whose values every report then carries and every MFU and MBU is
checked against. How the peaks themselves are measured is tested in tests/unit/test_roofline.py.
"""

from __future__ import annotations

from typing import Any

import pytest

REPEATS = 3  # best of three, as `folio bench serve` measures them (`measure_machine_peaks`)
_MEASURED: dict[tuple[str, str], Any] = {}  # (dtype, device) -> MachinePeaks


@pytest.fixture
def peaks_measured_once(monkeypatch):
    """`measure_peaks` (and so `measure_machine_peaks`, which calls it) measuring each dtype on each device
    once a session, best of REPEATS, at its first call; every later call gets that measurement."""
    from folio_tools.bench import decode
    from folio_tools.bench import quantization as quant_table
    from folio_tools.bench.harness import roofline
    from folio_tools.bench.parallel import command as parallel
    from folio_tools.bench.spec import command as spec
    from folio_tools.bench.structured import command as structured
    from folio_tools.bench.throughput import command as throughput

    real = roofline.measure_peaks

    def measure_once(dtype, repeats=REPEATS, device=None):
        key = (str(dtype), str(device or "cpu"))
        if key not in _MEASURED:
            _MEASURED[key] = real(dtype, REPEATS, device)
        return _MEASURED[key]

    for module in (roofline, decode, parallel, quant_table, spec, structured, throughput):
        monkeypatch.setattr(module, "measure_peaks", measure_once)
