"""The rejection sampler keeps the target's distribution exactly: checked against the formula on
hand-made p and q (one-hot drafts, as prompt lookup makes, and drafts drawn from a distribution)."""

from __future__ import annotations

import pytest
import torch

from folio.spec_decode.verification import verify_greedy, verify_sampled

P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
Q = torch.tensor([[0.1, 0.7, 0.1, 0.1], [0.4, 0.2, 0.2, 0.2]])


def test_greedy_accepts_the_prefix_equal_to_the_argmax_then_adds_the_targets_token():
    assert verify_greedy([3, 4, 5], [3, 4]) == [3, 4, 5]  # all accepted, then the bonus token
    assert verify_greedy([3, 9, 5], [3, 4]) == [3, 9]  # stops where they part, with the target's token
    assert verify_greedy([7, 4, 5], [3, 4]) == [7]
    assert verify_greedy([7], []) == [7]


def _first_tokens(draft_probs: torch.Tensor | None, draft: int | None, n: int = 20000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(n):
        d = draft if draft is not None else int(torch.multinomial(Q[0], 1, generator=generator))
        drafts = [d, 1]
        counts[verify_sampled(P, drafts, draft_probs, generator)[0]] += 1
    return counts / n


@pytest.mark.parametrize("draft", [0, 1, 3])
def test_one_hot_drafts_leave_the_targets_distribution(draft):
    """Accept x with probability p(x), else draw from p without x: the first token is distributed as p."""
    empirical = _first_tokens(None, draft)
    assert (empirical - P[0]).abs().sum() / 2 < 0.015


def test_drafts_drawn_from_q_leave_the_targets_distribution():
    """Accept with min(1, p/q), else draw from max(0, p - q) renormalised: the token is distributed as p
    whatever q is (Leviathan et al., theorem 1)."""
    empirical = _first_tokens(Q, None)
    assert (empirical - P[0]).abs().sum() / 2 < 0.015


def test_acceptance_rate_follows_the_formula():
    generator = torch.Generator().manual_seed(1)
    n, accepted = 20000, 0
    for _ in range(n):
        d = int(torch.multinomial(Q[0], 1, generator=generator))
        accepted += len(verify_sampled(P, [d, 1], Q, generator)) > 1
    assert accepted / n == pytest.approx(float(torch.minimum(P[0], Q[0]).sum()), abs=0.01)  # sum of min(p, q)


def test_all_accepted_then_the_bonus_token_comes_from_the_last_row():
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_sampled(certain, [1, 2], None, torch.Generator().manual_seed(0)) == [1, 2, 0]
    with pytest.raises(ValueError, match="1 drafts need 2 target rows, got 3"):
        verify_sampled(certain, [1])
