"""The C++ kernels let go of the GIL while they run, so a served engine's step leaves the interpreter to
the server's event loop: a Python thread keeps running while another thread is inside a kernel."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from folio import ops
from folio.weight_formats.int8_dot import tile_groups, tile_int8_codes
from tests.threads import torch_threads


@pytest.fixture
def one_thread():
    """The kernel on one core, the Python loop on the other."""
    with torch_threads(1):
        yield


def test_python_runs_while_a_kernel_computes(one_thread):
    kernel = ops.load("int8_dot")
    assert kernel is not None
    # Calls of tens of milliseconds even with AVX-512: a stall of one of the OS's time slices (a few ms,
    # when the other test worker holds the second core) must stay well under the bound below.
    rows, cols = 16384, 4096
    tiles = tile_int8_codes(torch.randint(-127, 127, (rows, cols), dtype=torch.int8))
    scales = tile_groups(torch.rand(rows, cols // 32))
    x = torch.randn(64, cols)
    start = time.perf_counter()
    kernel.int8_linear(x, tiles, scales, 32, rows)
    call = time.perf_counter() - start  # tens of milliseconds
    done = threading.Event()

    def compute() -> None:
        for _ in range(3):
            kernel.int8_linear(x, tiles, scales, 32, rows)
        done.set()

    worker = threading.Thread(target=compute)
    worker.start()
    longest_gap, last = 0.0, time.perf_counter()
    while not done.is_set():
        now = time.perf_counter()
        longest_gap, last = max(longest_gap, now - last), now
    worker.join()
    # Holding the GIL, the kernel would stall this loop for a whole call.
    assert longest_gap < call / 2, f"Python stalled {longest_gap * 1e3:.1f} ms during {call * 1e3:.1f} ms calls"
