"""The prefix top-k / top-p sets equal those of sorting each whole row (the implementation they replaced)."""

from __future__ import annotations

import pytest
import torch

from folio.sample import top_k_top_p
from folio.sample.top_k_top_p import nucleus_mask, top_k_top_p_kept


def top_k_top_p_keep(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    kept = top_k_top_p_kept(logits, top_k, top_p)
    return None if kept is None else kept.mask(logits.shape[-1])


def _keep_by_full_sort(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    remove = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    remove |= probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
    remove[:, 0] = False
    return ~torch.zeros_like(remove).scatter_(1, sorted_index, remove)


def _rows(vocab: int, scales: list[float], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(1, vocab, generator=generator) * scale for scale in scales])


@pytest.mark.parametrize("start", [1024, 3])  # 3: every nucleus row is wide, decided by the histogram
def test_prefix_sets_equal_the_full_sort(monkeypatch: pytest.MonkeyPatch, start: int):
    monkeypatch.setattr(top_k_top_p, "NUCLEUS_PREFIX", start)
    vocab = 5000
    # Sharp rows have small nuclei; flat rows (scale 0.1) need most of the vocabulary for top_p 0.99.
    logits = _rows(vocab, [8.0, 3.0, 1.0, 0.1, 0.1, 3.0, 1.0, 8.0, 0.1])
    logits[1, :2500] = float("-inf")  # a structured-output mask
    top_k = torch.tensor([0, 0, 0, 0, 0, 40, 7, 1, 0])
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.99, 1.0, 0.9, 1.0, 0.3, 0.999])
    keep = top_k_top_p_keep(logits, top_k, top_p)
    assert keep is not None
    assert torch.equal(keep, _keep_by_full_sort(logits, top_k, top_p))
    assert keep[4].all() and int(keep[6].sum()) == 7 and int(keep[5].sum()) <= 40
    assert int(keep[3].sum()) > 1024 and int(keep[8].sum()) > 4000  # past the first prefix


def test_no_filter_keeps_everything_and_returns_none():
    logits = _rows(100, [1.0, 1.0])
    assert top_k_top_p_keep(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0])) is None
    keep = top_k_top_p_keep(logits, torch.tensor([0, 5]), torch.tensor([1.0, 1.0]))
    assert keep is not None and keep[0].all() and int(keep[1].sum()) == 5


def test_top_k_past_the_vocabulary_and_tiny_top_p():
    logits = _rows(50, [2.0, 2.0, 2.0])
    top_k = torch.tensor([500, 0, 3])
    top_p = torch.tensor([1.0, 1e-6, 1e-6])
    keep = top_k_top_p_keep(logits, top_k, top_p)
    assert keep is not None and keep[0].all()
    best = logits.argmax(dim=-1)
    for row in (1, 2):  # only the best token
        assert int(keep[row].sum()) == 1 and bool(keep[row, best[row]])


def test_the_histogram_nucleus_on_ties_and_masked_tokens():
    """Equal probabilities share one bucket: the nucleus keeps as many of them as the sort would."""
    flat = torch.zeros(1, 1000)
    keep = nucleus_mask(flat.softmax(dim=-1), [0], torch.tensor([0.5]))
    assert int(keep.sum()) == int(_keep_by_full_sort(flat, torch.tensor([0]), torch.tensor([0.5])).sum()) == 500
    masked = torch.full((1, 1000), float("-inf"))
    masked[0, [3, 700, 999]] = torch.tensor([1.0, 2.0, 0.5])
    keep = nucleus_mask(masked.softmax(dim=-1), [0], torch.tensor([0.99]))
    assert keep[0].nonzero().flatten().tolist() == [3, 700, 999]
    everything = nucleus_mask(flat.softmax(dim=-1), [0], torch.tensor([1.0 - 1e-9]))  # rounds to 1: all kept
    assert everything.all()


def test_the_histogram_nucleus_of_many_rows_equals_the_full_sort():
    """More rows than one chunk of the histogram, taken out of a larger batch."""
    logits = _rows(3000, [0.3, 1.0, 2.0] * 4, seed=5)
    rows = [0, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    top_p = torch.linspace(0.5, 0.99, len(rows))
    keep = nucleus_mask(logits.softmax(dim=-1), rows, top_p)
    assert torch.equal(keep, _keep_by_full_sort(logits[rows], torch.zeros(len(rows), dtype=torch.long), top_p))
