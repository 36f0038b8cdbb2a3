"""Lookahead decoding (Fu et al., 2024), in the form folio's verification allows. The paper runs a
2-D lookahead branch (window W x n-gram size N) beside the verification branch under a custom attention
mask; folio scores a request's drafts causally in the flat batch, so here the verified drafts are the
Jacobi window. After drafts d_1..d_k are verified, the target's greedy choice t_j after d_1..d_j is
exact up to the first rejection and, past it, one Jacobi iteration's improvement of the guess for that
position: those corrections, shifted to the new position, are the next step's window. Each verified
row (the N - 1 tokens before it, then the target's choice) is an n-gram for the request's pool, as are
the prompt's and the output's own n-grams (TensorRT-LLM fills its pool from the prompt too). A step
proposes a pooled continuation of the last token (the one agreeing longest with the window, else the
most recent) or, when the pool has none, the window itself."""

from __future__ import annotations

import random
from collections.abc import Sequence

from folio.config import SpeculativeConfig
from folio.spec_decode.proposer import DraftRequest, Proposer, common_prefix

Ngram = tuple[int, ...]

# Keys a pool keeps (the least recently fed go first): ample for a context of tens of thousands of
# tokens, and a bound on what a long-lived server holds across requests.
MAX_REQUEST_KEYS = 1 << 14
MAX_SHARED_KEYS = 1 << 16


class NgramPool:
    """Up to `size` continuations (N - 1 tokens each) per key token, most recent last, over at most
    `max_keys` keys."""

    __slots__ = ("max_keys", "size", "table")

    def __init__(self, size: int, max_keys: int) -> None:
        self.size = size
        self.max_keys = max_keys
        self.table: dict[int, list[Ngram]] = {}

    def insert(self, key: int, continuation: Ngram) -> None:
        found = self.table.pop(key, None)  # put back below: the dict's order is the keys' recency
        if found is None:
            found = []
            if len(self.table) >= self.max_keys:
                del self.table[next(iter(self.table))]
        elif continuation in found:
            found.remove(continuation)  # seen again: it becomes the most recent
        elif len(found) >= self.size:
            del found[0]
        found.append(continuation)
        self.table[key] = found

    def add_sequence(self, tokens: Sequence[int], start: int, n: int) -> None:
        """The n-grams of `tokens` that end at index `start` or later."""
        for end in range(max(start, n - 1), len(tokens)):
            self.insert(tokens[end - n + 1], tuple(tokens[end - n + 2 : end + 1]))

    def get(self, key: int) -> list[Ngram]:
        return self.table.get(key, [])


class _Request:
    """A live request's pool, its Jacobi window, and how far its context had got at the last step."""

    __slots__ = ("guess", "length", "num_prompt_tokens", "output", "pool", "rng", "tail")

    def __init__(self, tokens: list[int], num_prompt_tokens: int, n: int, pool_size: int) -> None:
        self.pool = NgramPool(pool_size, MAX_REQUEST_KEYS)
        self.pool.add_sequence(tokens, 0, n)
        self.num_prompt_tokens = max(1, min(num_prompt_tokens, len(tokens)))
        self.output = tokens[self.num_prompt_tokens :]  # for the shared pool, at finish
        self.guess: list[int] = []  # the window: guesses for the positions from `length` on
        # Seeded by the prompt, so a request drafts the same whatever runs beside it (seeded sampling
        # draws differently with different drafts).
        self.rng = random.Random(hash(tuple(tokens[: self.num_prompt_tokens])))
        self.length = 0
        self.tail: list[int] = []

    def random_prompt_token(self, tokens: list[int]) -> int:
        return tokens[self.rng.randrange(self.num_prompt_tokens)]


class LookaheadProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n = config.lookahead_ngram_size
        self.pool_size = config.lookahead_pool_size
        self.requests: dict[str, _Request] = {}
        self.shared = NgramPool(self.pool_size, MAX_SHARED_KEYS)  # finished requests' outputs

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request in requests:
            state = self._follow(request)
            want = min(self.k, request.max_tokens)
            if want > 0:
                drafts[request.request_id] = self._draft(state, request.token_ids, want)
        return drafts

    def finish(self, request_id: str, token_ids: list[int]) -> None:
        # The proposer's own copy of the output: the runner's may end with drafts its last step rejected.
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.shared.add_sequence(state.output, 0, self.n)

    def _follow(self, request: DraftRequest) -> _Request:
        """The request's state, having learned from what the step added. A context that did not grow
        from the one last seen (a different request under a reused id) starts afresh."""
        tokens, state = request.token_ids, self.requests.get(request.request_id)
        if state is not None:
            old = state.length
            if len(tokens) <= old or tokens[max(0, old - self.n + 1) : old] != state.tail:
                state = None
        if state is None:
            state = self.requests[request.request_id] = _Request(
                tokens, request.num_prompt_tokens, self.n, self.pool_size
            )
        else:
            self._learn(state, request)
        state.length = len(tokens)
        state.tail = tokens[-(self.n - 1) :]
        return state

    def _learn(self, state: _Request, request: DraftRequest) -> None:
        """Iterate the window on the verification's rows and pool their n-grams, then the context's."""
        tokens, old, n = request.token_ids, state.length, self.n
        drafts, choices = request.verified_drafts, request.target_choices
        k, kept = len(drafts), len(tokens) - old - 1  # the step gained the kept drafts and one token
        if k and len(choices) == k + 1 and kept <= k and tokens[old : old + kept] == list(drafts[:kept]):
            row = tokens[max(0, old - n + 1) : old] + list(drafts)
            first = len(row) - k  # where d_1 is in `row`
            for j in range(kept + 1, k + 1):  # the rejected rows: row j read d_1..d_j, then chose t_j
                end = first + j
                if end >= n - 1:
                    state.pool.insert(row[end - n + 1], (*row[end - n + 2 : end], choices[j]))
            state.guess = list(choices[kept + 1 :])  # t_j guesses the position old + j
        else:
            state.guess = state.guess[kept + 1 :]  # nothing verified: the guesses still ahead stay
        state.pool.add_sequence(tokens, old, n)  # the exact n-grams, fed last: they are the most recent
        state.output += tokens[max(old, state.num_prompt_tokens) :]

    def _draft(self, state: _Request, tokens: list[int], want: int) -> list[int]:
        """The window, filled up to `want` tokens, or a pooled continuation of the last token."""
        guess = state.guess
        while len(guess) < want:  # chain pooled continuations from the window's end; else a prompt token
            found = state.pool.get(guess[-1] if guess else tokens[-1])
            guess.extend(found[-1] if found else (state.random_prompt_token(tokens),))
        candidates = state.pool.get(tokens[-1]) or self.shared.get(tokens[-1])
        draft = guess[:want]
        if candidates:
            best, agreed = candidates[-1], -1
            for candidate in reversed(candidates):  # most recent first, so it wins ties
                same = common_prefix(candidate, guess)
                if same > agreed:
                    best, agreed = candidate, same
            draft = [*best[:want], *guess[len(best) : want]]
        state.guess = draft  # what the next verification iterates
        return draft
