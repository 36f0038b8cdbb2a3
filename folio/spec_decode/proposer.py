"""What every proposer is to the runner: given the requests that may speculate this step (their
context so far and how many drafts each may take), draft each one's next tokens. Proposers see values
only; the target's verification (spec_decode/verification.py) decides what is kept."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftRequest:
    request_id: str
    token_ids: list[int]  # prompt + output, including the tokens this step just gained
    num_prompt_tokens: int
    max_tokens: int  # drafts it may take (its adaptive draft length)
    # The verification this step ran, if any: the drafts it checked and the target's own greedy choice
    # at each of their k + 1 rows (lookahead decoding learns n-grams from the rows it rejected).
    verified_drafts: tuple[int, ...] = ()
    target_choices: tuple[int, ...] = ()
    # The target's block tables, one per KV cache group: its cache holds every context position but the
    # last (a draft of the same architecture copies those K/V instead of recomputing them).
    block_tables: tuple[tuple[int, ...], ...] = ()


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """Drafts for some of `requests`, at most `max_tokens` each; a request left out verifies nothing."""

    def finish(self, request_id: str, token_ids: list[int]) -> None:  # noqa: B027 - stateless proposers keep nothing
        """The request is done (`token_ids`: its prompt and output as the runner last saw them): forget
        whatever was kept for it; a proposer that learns across requests keeps what it learned."""


# Each request's draft length follows its own acceptance: drafts kept, it drafts more (up to
# num_speculative_tokens); drafts rejected, it drafts less (down to one), so a request whose text does
# not repeat its context wastes little of each step on drafts.
def next_draft_length(current: int, num_drafted: int, num_accepted: int, most: int) -> int:
    """After a verification of `num_drafted` drafts of which `num_accepted` were kept."""
    if num_accepted == num_drafted:
        return min(most, current + 1)
    return max(1, num_accepted + 1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, a context having only grown: one C-level comparison
        return n
    return next((i for i in range(n) if a[i] != b[i]), n)  # a tuple and a list never compare equal
