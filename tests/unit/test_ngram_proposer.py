"""Prompt lookup proposes what followed the most recent earlier match of the longest suffix; each
request's draft length follows its acceptance."""

from __future__ import annotations

from folio.config import SpeculativeConfig
from folio.spec_decode.ngram import NgramProposer
from folio.spec_decode.proposer import next_draft_length


def _proposer(k: int = 3, n_min: int = 1, n_max: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=n_min, prompt_lookup_max=n_max))


def test_continues_the_longest_suffix_match():
    # "2 3" occurs earlier followed by 4 5 6; "3" alone also follows 9 at the end of the context
    assert _proposer().lookup([1, 2, 3, 4, 5, 6, 7, 3, 9, 1, 2, 3]) == [4, 5, 6]


def test_prefers_the_most_recent_match_and_caps_at_k():
    assert _proposer(k=2).lookup([5, 1, 2, 5, 3, 4, 5]) == [3, 4]
    assert _proposer(k=4).lookup([5, 1, 2, 5, 3, 4, 5], max_tokens=1) == [3]


def test_no_match_no_proposal():
    assert _proposer().lookup([1, 2, 3, 4]) == []
    assert _proposer(n_min=2).lookup([1, 2, 3, 1]) == []  # only a 1-gram matches
    assert _proposer().lookup([7]) == []


def test_the_continuation_may_run_into_the_suffix_itself():
    assert _proposer(k=4).lookup([8, 8, 8]) == [8]  # the earlier "8 8" is followed by one token only


def test_the_draft_length_follows_acceptance():
    assert next_draft_length(2, num_drafted=2, num_accepted=2, most=4) == 3  # all kept: one more
    assert next_draft_length(4, num_drafted=4, num_accepted=4, most=4) == 4  # never past the most
    assert next_draft_length(4, num_drafted=4, num_accepted=1, most=4) == 2  # one more than were kept
    assert next_draft_length(3, num_drafted=3, num_accepted=0, most=4) == 1  # never below one
