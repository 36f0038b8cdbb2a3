"""Lookahead decoding: the n-gram pool keeps the most recent continuations per key within its bounds;
the Jacobi window is the verified drafts, iterated on the target's choices at their rows; a pooled
continuation of the last token is proposed before the window, the one agreeing with the window first."""

from __future__ import annotations

import pytest
import torch

from folio.config import SpeculativeConfig
from folio.spec_decode.factory import make_proposer
from folio.spec_decode.lookahead import LookaheadProposer, NgramPool
from folio.spec_decode.proposer import DraftRequest

PROMPT = list(range(10, 20))  # distinct tokens: the prompt's pool continues each token one way only


def _proposer(k: int = 3, n: int = 3, pool: int = 4) -> LookaheadProposer:
    config = SpeculativeConfig(method="lookahead", num_speculative_tokens=k, lookahead_ngram_size=n,
                               lookahead_pool_size=pool)  # fmt: skip
    return LookaheadProposer(config)


def _propose(proposer: LookaheadProposer, tokens: list[int], drafts=(), choices=(), most: int = 8) -> list[int]:
    request = DraftRequest("r", tokens, len(PROMPT), most, tuple(drafts), tuple(choices))
    return proposer.propose([request]).get("r", [])


def test_the_pool_keeps_the_most_recent_continuations_per_key():
    pool = NgramPool(size=2, max_keys=8)
    for continuation in [(1, 2), (3, 4), (5, 6)]:
        pool.insert(7, continuation)
    assert pool.get(7) == [(3, 4), (5, 6)]  # the oldest went
    pool.insert(7, (3, 4))
    assert pool.get(7) == [(5, 6), (3, 4)]  # seen again: most recent, and nothing else dropped
    assert pool.get(8) == []


def test_the_pool_forgets_the_key_fed_longest_ago():
    pool = NgramPool(size=2, max_keys=2)
    pool.insert(1, (2,))
    pool.insert(2, (3,))
    pool.insert(1, (4,))  # key 1 fed again: key 2 is now the oldest
    pool.insert(3, (5,))
    assert (pool.get(1), pool.get(2), pool.get(3)) == ([(2,), (4,)], [], [(5,)])


def test_the_pool_holds_a_sequences_ngrams():
    pool = NgramPool(size=4, max_keys=64)
    pool.add_sequence([1, 2, 3, 1, 2, 4], 0, 3)
    assert pool.get(1) == [(2, 3), (2, 4)] and pool.get(2) == [(3, 1)] and pool.get(3) == [(1, 2)]
    later = NgramPool(size=4, max_keys=64)
    later.add_sequence([1, 2, 3, 1, 2, 4], 5, 3)  # only the n-gram ending at index 5
    assert later.table == {1: [(2, 4)]}


def test_with_nothing_verified_yet_the_window_starts_from_the_prompt():
    first = _propose(_proposer(k=3), [*PROMPT, 99])
    assert len(first) == 3 and set(first) <= set(PROMPT)
    # Seeded by the prompt: the same request drafts the same in another proposer.
    assert _propose(_proposer(k=3), [*PROMPT, 99]) == first
    assert len(_propose(_proposer(k=3), [*PROMPT, 99], most=2)) == 2
    assert _propose(_proposer(k=3), [*PROMPT, 99], most=0) == []


def test_a_rejection_shifts_the_targets_corrections_into_the_window():
    proposer = _proposer(k=3)
    d = _propose(proposer, [*PROMPT, 99])
    # d_1 was kept, d_2 rejected (the target chose 98); past it, the target chose 97 and 96.
    nxt = _propose(proposer, [*PROMPT, 99, d[0], 98], drafts=d, choices=[d[0], 98, 97, 96])
    assert nxt[:2] == [97, 96]  # t_2, t_3 guess the two positions after the new token
    # Each rejected row, as the N - 1 tokens it read and the target's choice, is a pooled n-gram.
    state = proposer.requests["r"]
    assert (d[1], 97) in state.pool.get(d[0]) and (d[2], 96) in state.pool.get(d[1])


def test_a_fully_accepted_window_starts_again_from_the_pool():
    proposer = _proposer(k=3)
    d = _propose(proposer, [*PROMPT, 99])
    context = [*PROMPT, 99, *d, 15]  # every draft kept, then the target's own token (15, from the prompt)
    nxt = _propose(proposer, context, drafts=d, choices=[*d, 15])
    assert nxt == [16, 17, 18]  # nothing of the window is left: the prompt's continuation of 15, chained
    assert proposer.requests["r"].pool.get(99) == [(d[0], d[1])]  # the output's exact n-grams, no others


def test_a_step_without_verification_keeps_the_guesses_still_ahead():
    proposer = _proposer(k=3)
    d = _propose(proposer, [*PROMPT, 99])
    nxt = _propose(proposer, [*PROMPT, 99, 98])  # the drafts were not scheduled: one token gained
    assert nxt[:2] == d[1:]


def test_a_pooled_continuation_of_the_last_token_beats_the_window():
    proposer = _proposer(k=3)
    context = [*PROMPT, 50, 60, 70, 99]
    d = _propose(proposer, context)
    # Rejected at the first draft: the window is then (t_1, t_2, t_3) = (51, 52, 53), but the new
    # token 50 was seen before, followed by 60 70: the pool's continuation goes first.
    nxt = _propose(proposer, [*context, 50], drafts=d, choices=[50, 51, 52, 53])
    assert nxt == [60, 70, 53]  # the window fills in past the pooled n-gram, position for position
    # Among several continuations, the one agreeing longest with the window wins over a newer one.
    proposer = _proposer(k=3)
    context = [*PROMPT, 50, 51, 5, 50, 60, 70, 99]
    d = _propose(proposer, context)
    assert _propose(proposer, [*context, 50], drafts=d, choices=[50, 51, 52, 53]) == [51, 5, 53]


def test_finished_outputs_feed_the_shared_pool():
    proposer = _proposer(k=2)
    d = _propose(proposer, [*PROMPT, 40])
    assert len(d) == 2
    _propose(proposer, [*PROMPT, 40, 41, 42, 43])  # the drafts were not verified; three tokens gained
    proposer.finish("r", [*PROMPT, 40, 41, 42, 43])
    assert proposer.requests == {} and proposer.shared.get(41) == [(42, 43)]
    other = DraftRequest("s", [1, 2, 3, 41], 3, 2)
    assert proposer.propose([other]) == {"s": [42, 43]}


def test_a_reused_id_with_another_context_starts_afresh():
    proposer = _proposer(k=2)
    _propose(proposer, [*PROMPT, 99])
    _propose(proposer, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    state = proposer.requests["r"]
    assert state.pool.get(99) == [] and state.pool.get(10) == [(11, 12)]


def test_config_and_factory():
    for bad in ({"lookahead_ngram_size": 1}, {"lookahead_pool_size": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeculativeConfig(method="lookahead", **bad)
    proposer = make_proposer(SpeculativeConfig(method="lookahead"), None, 4, 16, torch.float32, torch.device("cpu"))
    assert isinstance(proposer, LookaheadProposer) and (proposer.n, proposer.pool_size) == (4, 8)
