"""Each request's draft length follows its own acceptance: a request whose drafts keep being accepted
drafts more (up to num_speculative_tokens), one whose drafts fail drafts less (down to one), so a
request whose text does not repeat its context wastes little of each step on drafts."""

from __future__ import annotations


def next_draft_length(current: int, num_drafted: int, num_accepted: int, most: int) -> int:
    """After a verification of `num_drafted` drafts of which `num_accepted` were kept."""
    if num_accepted == num_drafted:
        return min(most, current + 1)
    return max(1, num_accepted + 1)
