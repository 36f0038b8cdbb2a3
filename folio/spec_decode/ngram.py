"""Prompt lookup ("inference with reference"): find the request's last n tokens earlier in its own
context (prompt and output), and propose the tokens that followed them there. No extra model: it pays
off where outputs copy from the input (summaries, edits, extraction, code)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from folio.config import SpeculativeConfig
from folio.spec_decode.proposer import DraftRequest, Proposer


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts = {r.request_id: self.lookup(r.token_ids, r.max_tokens) for r in requests}
        return {request_id: found for request_id, found in drafts.items() if found}

    def lookup(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the longest suffix (n from
        prompt_lookup_max down to prompt_lookup_min); [] when nothing matches."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0 or len(token_ids) < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # every earlier n-gram; the suffix itself excluded
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match: nearest context wins
                return tokens[start : start + k].tolist()
        return []
