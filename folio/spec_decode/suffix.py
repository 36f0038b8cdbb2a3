"""SuffixDecoding (Oliaro et al., 2024; Arctic Inference's and vLLM's `suffix` method): draft from
suffix trees of what was already said. Each live request has a tree of its own prompt and output,
extended as tokens arrive; one global tree holds the outputs of the last `suffix_max_cached_requests`
finished requests. A draft continues the request's context along the most frequent path in a tree, so
it pays off where outputs repeat: agent loops, tool calls, rewrites, structured replies."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from folio.config import SpeculativeConfig
from folio.spec_decode.proposer import DraftRequest, Proposer
from folio.spec_decode.suffix_tree import Cursor, Node, SuffixTree


class _Request:
    """A live request's own tree (its prompt and output so far) and where its context has got to."""

    __slots__ = ("cursor", "num_prompt_tokens", "tree")

    def __init__(self, max_depth: int, num_prompt_tokens: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.cursor = Cursor()
        self.num_prompt_tokens = num_prompt_tokens


class SuffixProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_depth = config.suffix_max_tree_depth
        self.max_cached_requests = config.suffix_max_cached_requests
        self.max_spec_factor = config.suffix_max_spec_factor
        self.min_token_prob = config.suffix_min_token_prob
        self.requests: dict[str, _Request] = {}
        self.global_tree = SuffixTree(self.max_depth)
        self.cached: deque[list[int]] = deque()  # finished outputs in the global tree, oldest first

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for request in requests:
            state = self._follow(request)
            found = self._draft(state, min(self.k, request.max_tokens))
            if found:
                drafts[request.request_id] = found
        return drafts

    def finish(self, request_id: str, token_ids: list[int]) -> None:
        # The proposer's own copy of the context, not `token_ids`: the runner's may end with drafts its
        # last step rejected, and lack the tokens that step gained.
        state = self.requests.pop(request_id, None)
        if state is None or self.max_cached_requests == 0:
            return
        output = state.cursor.tokens[state.num_prompt_tokens :]
        if not output:
            return
        cursor = Cursor()
        self.global_tree.extend(cursor, output)
        self.cached.append(cursor.tokens)
        while len(self.cached) > self.max_cached_requests:
            self.global_tree.remove(self.cached.popleft())

    def _follow(self, request: DraftRequest) -> _Request:
        """The request's tree, extended by the tokens its context gained since the last step. The
        runner's contexts only grow; one that did otherwise near its end (a different request under a
        reused id) is built again. Only the last `max_depth` tokens are compared, to keep this O(depth)."""
        tokens, state = request.token_ids, self.requests.get(request.request_id)
        if state is not None:
            seen = state.cursor.tokens
            n = len(seen)
            back = max(0, n - self.max_depth)
            if len(tokens) < n or tokens[back:n] != seen[back:]:
                state = None
        if state is None:
            state = self.requests[request.request_id] = _Request(self.max_depth, request.num_prompt_tokens)
        state.tree.extend(state.cursor, tokens[len(state.cursor.tokens) :])
        return state

    def _draft(self, state: _Request, limit: int) -> list[int]:
        """The best-scoring draft over every suffix of the context either tree has seen continue (the
        request's own first, then the global one; ties keep the longer match, then the request's)."""
        if limit <= 0:
            return []
        best: list[int] = []
        best_score = 0.0
        trees = (
            (state.tree, ((length, node, 0) for length, node in state.tree.open_matches(state.cursor))),
            (self.global_tree, self._global_matches(state.cursor.tokens)),
        )
        for tree, matches in trees:
            for length, node, extra in matches:  # longest first, so the caps only shrink
                cap = min(limit, int(length * self.max_spec_factor + 1e-6))
                if cap <= best_score:  # every token scores at most 1: this and shorter matches cannot win
                    break
                tokens, score = tree.draft(node, extra, cap, self.min_token_prob)
                if score > best_score:
                    best, best_score = tokens, score
        return best

    def _global_matches(self, context: list[int]) -> Iterable[tuple[int, Node, int]]:
        """(length, node, tokens past it in its tail) of each suffix of `context` the global tree holds,
        longest first. A suffix held means all shorter ones are: stop at the first one missing."""
        found: list[tuple[int, Node, int]] = []
        # A node at the tree's depth has no continuation: matches stop one short of it.
        for length in range(1, min(len(context), self.max_depth - 1) + 1):
            where = self.global_tree.locate(context, len(context) - length)
            if where is None:
                break
            found.append((length, *where))
        return reversed(found)
