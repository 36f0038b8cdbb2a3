"""Fault injection shared by the fault tests: a sampler that raises for the rows of marked requests."""

from __future__ import annotations

import pytest

from folio.worker import row_sampling

MARK = 7777  # top_k of the requests whose rows fault


def fail_marked_rows_in_the_sampler(monkeypatch: pytest.MonkeyPatch, mark: int = MARK) -> None:
    """The batched sampler raises whenever a row with top_k == `mark` is in its batch, as a parameter the
    sampler's tensors could not hold would."""
    real = row_sampling.sample

    def sample(logits, batch):
        if bool((batch.top_k == mark).any()):
            raise RuntimeError("injected sampler fault")
        return real(logits, batch)

    monkeypatch.setattr(row_sampling, "sample", sample)
