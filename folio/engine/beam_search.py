"""Beam search as transformers does it, one step at a time, with no model and no KV cache in sight.

Each step every live beam reports its best next tokens (log-softmax, top `num_candidates`); the step
keeps the `num_candidates` best continuations over all beams by cumulative logprob. Of those, the
ones that end (EOS, or the length limit) become finished hypotheses when they rank among the first
`beam_width` (score = cumulative logprob / generated length ** length_penalty); the best
`beam_width` that do not end are the next live beams. The search stops when no live beam can beat
the worst kept hypothesis (`early_stopping` False or "never", transformers' heuristics), as soon as
`beam_width` hypotheses exist (True), or when every continuation ends.

Scores are float32, as in transformers, so that near-ties break the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from folio.step import BeamCandidates

EarlyStopping = bool | Literal["never"]


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated tokens, the final EOS included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    ended_with_eos: bool


@dataclass
class Continuation:
    parent: int  # index of the live beam it extends
    token_id: int
    cumulative_logprob: float


@dataclass(eq=False)
class BeamSearch:
    beam_width: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    finished: list[BeamHypothesis] = field(default_factory=list, init=False)  # the best beam_width, best first
    num_generated: int = field(default=0, init=False)
    done: bool = field(default=False, init=False)
    _improvable: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        # Enough continuations that beam_width of them survive even if the best all end in an EOS.
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * self.beam_width

    def step(
        self, beams: Sequence[tuple[list[int], float]], candidates: Sequence[BeamCandidates]
    ) -> list[Continuation]:
        """`beams`: each live beam's generated tokens and cumulative logprob; `candidates`: its best next
        tokens. Returns the next live beams, best first (empty when the search is done)."""
        scores = torch.cat([c.logprobs + torch.tensor(score, dtype=torch.float32)
                            for (_, score), c in zip(beams, candidates, strict=True)])  # fmt: skip
        parents = torch.cat([torch.full_like(c.token_ids, b) for b, c in enumerate(candidates)])
        token_ids = torch.cat([c.token_ids for c in candidates])
        top_scores, order = scores.topk(min(self.num_candidates, len(scores)))
        length = self.num_generated + 1
        penalized = top_scores / (length**self.length_penalty)

        accepts = self._improvable and not (self.early_stopping is True and len(self.finished) == self.beam_width)
        live: list[Continuation] = []
        ranked = zip(order.tolist(), top_scores.tolist(), penalized.tolist(), strict=True)
        for rank, (index, total, final) in enumerate(ranked):
            parent, token = int(parents[index]), int(token_ids[index])
            is_eos = token in self.eos_token_ids
            if is_eos or length >= self.max_new_tokens:
                # Only the first beam_width continuations may become hypotheses; the rest are spares.
                if rank < self.beam_width and accepts:
                    tokens = [*beams[parent][0], token]
                    self.finished.append(BeamHypothesis(tokens, total, final, is_eos))
            elif len(live) < self.beam_width:
                live.append(Continuation(parent, token, total))
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.beam_width :]
        self.num_generated = length
        self._update_improvable(live)
        full = len(self.finished) == self.beam_width
        self.done = not live or not self._improvable or (self.early_stopping is True and full)
        return [] if self.done else live

    def best(self, n: int) -> list[BeamHypothesis]:
        return self.finished[:n]

    def _update_improvable(self, live: list[Continuation]) -> None:
        """Could the best live beam still beat the worst kept hypothesis? (transformers' heuristic)"""
        if len(self.finished) < self.beam_width or not live:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.num_generated
        best_possible = torch.tensor(live[0].cumulative_logprob, dtype=torch.float32) / (
            best_length**self.length_penalty
        )
        self._improvable = bool(best_possible > self.finished[-1].score)
