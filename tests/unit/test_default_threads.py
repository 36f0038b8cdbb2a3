"""folio's engines and benchmarks take every core, unless OMP_NUM_THREADS says otherwise (as torch,
llama.cpp's OpenMP builds and a test worker's share of the machine do)."""

from __future__ import annotations

import os

import pytest
import torch

from folio.platform import configure_threads, default_threads
from tests.threads import torch_threads


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("3", 3), ("", None), ("zero", None), ("0", None)])
def test_omp_num_threads_is_honoured_when_it_is_a_positive_count(monkeypatch, value, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert default_threads() == (expected or os.cpu_count())


def test_every_core_without_it(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == os.cpu_count()


def test_an_engine_sets_torchs_threads_to_it(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with torch_threads(2):
        configure_threads()
        assert torch.get_num_threads() == 1
