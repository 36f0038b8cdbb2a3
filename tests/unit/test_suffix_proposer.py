"""SuffixDecoding: the suffix tree counts every string of up to `max_depth` tokens however its
sequences arrive and leave, and the proposer drafts the likeliest continuation of the longest suffixes
it has seen continue, from the request's own context or from earlier requests' outputs."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch

from folio.config import SpeculativeConfig
from folio.spec_decode.factory import make_proposer
from folio.spec_decode.proposer import DraftRequest
from folio.spec_decode.suffix import SuffixProposer
from folio.spec_decode.suffix_tree import Cursor, SuffixTree


def _count(tree: SuffixTree, string: list[int]) -> int:
    """How often the tree says `string` occurs (a tail stands for exactly one occurrence)."""
    found = tree.locate(string, 0)
    if found is None:
        return 0
    node, extra = found
    return 1 if extra or node.children is None else node.count


def _substrings(sequences: list[list[int]], max_depth: int) -> Counter[tuple[int, ...]]:
    return Counter(
        tuple(s[i:j]) for s in sequences for i in range(len(s)) for j in range(i + 1, min(i + max_depth, len(s)) + 1)
    )


def _assert_counts(tree: SuffixTree, sequences: list[list[int]], alphabet: int) -> None:
    expected = _substrings(sequences, tree.max_depth)
    for string, n in expected.items():
        assert _count(tree, list(string)) == n, string
    rng = random.Random(0)
    for length in range(1, tree.max_depth + 2):  # strings never seen, and ones too long to be held
        string = [rng.randrange(alphabet) for _ in range(length)]
        assert _count(tree, string) == expected.get(tuple(string), 0)
    assert tree.root.count == sum(map(len, sequences))


def _proposer(k: int = 4, **suffix: Any) -> SuffixProposer:
    options = {f"suffix_{name}": value for name, value in suffix.items()}
    return SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=k, **options))


def _propose(proposer: SuffixProposer, request_id: str, tokens: list[int], num_prompt: int = 0, most: int = 8):
    return proposer.propose([DraftRequest(request_id, tokens, num_prompt, most)]).get(request_id, [])


def test_counts_each_string_up_to_the_depth():
    tree, cursor = SuffixTree(max_depth=3), Cursor()
    tree.extend(cursor, [1, 2, 3, 1, 2, 4, 1, 2])
    assert (_count(tree, [1, 2]), _count(tree, [1, 2, 3]), _count(tree, [2, 4, 1]), _count(tree, [4])) == (3, 1, 1, 1)
    assert _count(tree, [1, 2, 3, 1]) == 0  # longer than the depth: not held
    node, extra = tree.locate([1, 2], 0)
    assert extra == 0 and node.best is not None and {t: c.count for t, c in node.children.items()} == {3: 1, 4: 1}


@pytest.mark.parametrize("seed", range(12))
def test_growing_and_removing_sequences_keep_exact_counts(seed):
    """Sequences grown a few tokens at a time, in turns (so a tail can meet its own next token), then
    removed: every string's count is its number of occurrences, as a from-scratch count says."""
    rng = random.Random(seed)
    alphabet = rng.randint(1, 4)  # few symbols: much repetition, tails split often
    tree = SuffixTree(max_depth=rng.randint(2, 6))
    cursors = [Cursor() for _ in range(3)]
    for _ in range(30):
        tree.extend(rng.choice(cursors), [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))])
        _assert_counts(tree, [c.tokens for c in cursors], alphabet)
    for i, cursor in enumerate(cursors):
        tree.remove(cursor.tokens)
        _assert_counts(tree, [c.tokens for c in cursors[i + 1 :]], alphabet)
    assert tree.root.children == {}


def test_the_most_frequent_child_is_tracked_through_removal():
    tree = SuffixTree(max_depth=2)
    first, second = Cursor(), Cursor()
    tree.extend(first, [7, 1, 7, 1])
    tree.extend(second, [7, 2, 7, 2, 7, 2])
    assert tree.locate([7], 0)[0].best.token == 2
    tree.remove(second.tokens)
    assert tree.locate([7], 0)[0].best.token == 1


def test_a_repeat_in_the_request_is_continued():
    # "5 6 7" was followed by 8 9 1: its draft is capped at the match's length (3), each token with
    # probability 1/2 (the suffix itself is the second of the two occurrences)
    assert _propose(_proposer(), "a", [5, 6, 7, 8, 9, 1, 5, 6, 7]) == [8, 9, 1]
    assert _propose(_proposer(), "a", [1, 2, 3, 4]) == []  # nothing repeats
    assert _propose(_proposer(k=2), "a", [5, 6, 7, 8, 9, 1, 5, 6, 7]) == [8, 9]
    assert _propose(_proposer(), "a", [5, 6, 7, 8, 9, 1, 5, 6, 7], most=1) == [8]  # its adaptive draft length
    assert _propose(_proposer(), "a", [5, 6, 7, 8, 9, 1, 5, 6, 7], most=0) == []


def test_the_draft_is_at_most_spec_factor_times_the_match():
    context = [4, 5, 6, 7, 8, 9, 3, 2, 5, 6]  # the longest repeated suffix is "5 6"
    assert _propose(_proposer(max_spec_factor=1.0), "a", context) == [7, 8]
    assert _propose(_proposer(max_spec_factor=0.5), "a", context) == [7]
    assert _propose(_proposer(max_spec_factor=2.0), "a", context) == [7, 8, 9, 3]


def test_outputs_of_finished_requests_draft_for_later_ones():
    proposer = _proposer(max_spec_factor=4.0)
    assert _propose(proposer, "new", [30, 31, 10, 11]) == []
    _propose(proposer, "old", [20, 21, 22, 10, 11, 12, 13, 14], num_prompt=3)
    proposer.finish("old", [])
    assert proposer.requests.keys() == {"new"}  # a finished request's own tree is gone
    assert _propose(proposer, "new", [30, 31, 10, 11, 12]) == [13, 14]  # its output, probability 1
    assert _propose(proposer, "other", [21, 22, 10]) == [11, 12, 13, 14]
    assert _propose(proposer, "prompt", [99, 21, 22]) == []  # prompts stay out of the global tree


def test_the_path_stops_where_its_probability_falls_below_the_minimum():
    def after_one(min_prob: float) -> list[int]:
        proposer = _proposer(max_spec_factor=4.0, min_token_prob=min_prob)
        for i, output in enumerate(([1, 2, 3], [1, 2, 4], [1, 5, 6])):
            _propose(proposer, str(i), [0, *output], num_prompt=1)
            proposer.finish(str(i), [])
        return _propose(proposer, "next", [9, 1])

    # after "1": 2 (2 of 3), then 3 or 4 (1 of 2 each, the first seen kept): 2/3, then 1/3 along the path
    assert after_one(0.3) == [2, 3]
    assert after_one(0.4) == [2]
    assert after_one(0.7) == []


def test_the_higher_scoring_tree_wins():
    proposer = _proposer()
    for i in range(3):  # the global tree has seen "3 4" go on to 5 6 three times out of three
        _propose(proposer, str(i), [0, 3, 4, 5, 6], num_prompt=1)
        proposer.finish(str(i), [])
    # the request saw "3 4" go on to 8 once: probability 1/2 a token, against the global tree's 1
    assert _propose(proposer, "r", [3, 4, 8, 1, 3, 4]) == [5, 6]


def test_the_global_tree_keeps_the_latest_outputs_only():
    proposer = _proposer(max_cached_requests=2)
    outputs = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    for i, output in enumerate(outputs):
        _propose(proposer, str(i), [0, *output], num_prompt=1)
        proposer.finish(str(i), [])
    assert list(proposer.cached) == [[20, 21, 22], [30, 31, 32]]
    assert _count(proposer.global_tree, [10]) == 0 and _count(proposer.global_tree, [20, 21]) == 1
    assert proposer.global_tree.root.count == 6
    assert _propose(proposer, "r", [5, 10, 11]) == [] and _propose(proposer, "s", [5, 30, 31]) == [32]
    none = _proposer(max_cached_requests=0)
    _propose(none, "a", [0, 1, 2], num_prompt=1)
    none.finish("a", [])
    assert not none.cached and none.global_tree.root.count == 0


@pytest.mark.parametrize("seed", range(4))
def test_a_tree_grown_step_by_step_drafts_as_one_built_at_once(seed):
    rng = random.Random(seed)
    context = [rng.randrange(5) for _ in range(120)]
    grown = _proposer(k=6, max_tree_depth=8, max_spec_factor=2.0)
    end = 10
    while end <= len(context):
        fresh = _proposer(k=6, max_tree_depth=8, max_spec_factor=2.0)
        assert _propose(grown, "r", context[:end]) == _propose(fresh, "r", context[:end])
        end += rng.randint(1, 5)
    _assert_counts(grown.requests["r"].tree, [grown.requests["r"].cursor.tokens], 5)


def test_a_context_that_changed_otherwise_is_built_again():
    proposer = _proposer()
    _propose(proposer, "r", [5, 6, 7, 8, 9, 1, 5, 6, 7])
    assert _propose(proposer, "r", [5, 6, 7, 2, 3, 5, 6, 7]) == [2, 3, 5]  # not an extension: rebuilt
    assert proposer.requests["r"].cursor.tokens == [5, 6, 7, 2, 3, 5, 6, 7]
    assert _propose(proposer, "r", [5, 6]) == []  # shorter: rebuilt too


def test_config_validation_and_factory():
    proposer = make_proposer(SpeculativeConfig(method="suffix"), None, 4, 16, torch.float32, torch.device("cpu"))
    assert isinstance(proposer, SuffixProposer)
    bad = [
        ({"suffix_max_tree_depth": 1}, "suffix_max_tree_depth"),
        ({"suffix_max_cached_requests": -1}, "suffix_max_cached_requests"),
        ({"suffix_max_spec_factor": 0.0}, "suffix_max_spec_factor"),
        ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob"),
    ]
    for options, name in bad:
        with pytest.raises(ValueError, match=name):
            SpeculativeConfig(method="suffix", **options)
