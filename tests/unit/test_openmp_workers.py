"""The thread that loads a model lets its OpenMP workers go when the engine thread takes over
(platform.release_openmp_workers): libgomp gives each thread that runs parallel regions its own team,
and with more threads than cores it stops spinning at barriers, which slowed the engine thread 2.2x."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from folio.platform import release_openmp_workers
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info(),
    reason="counts the process's threads in /proc; torch's intra-op threads are OpenMP's",
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_threads():
    with torch_threads(2):
        yield


def test_this_threads_team_stops_and_starts_again_when_needed(two_threads):
    x = torch.randn(512, 512)
    expected = x @ x  # a parallel region on this thread: its team of workers exists now
    with_team = _threads()
    assert release_openmp_workers()
    # Its worker is gone once it has run to its end, which on a loaded machine can take a time slice.
    deadline = time.monotonic() + 5
    while _threads() >= with_team and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() < with_team
    torch.testing.assert_close(x @ x, expected)  # the next parallel region starts a team again
    assert _threads() == with_team
