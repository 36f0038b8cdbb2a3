"""The scheduler's decision for one engine step: which requests run, and how many tokens each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from folio.sampling_params import SamplingParams

if TYPE_CHECKING:
    from folio.structured.grammar import TokenGrammar


@dataclass
class ForkedSample:
    """A request forked from the one scheduled: it shares that request's prompt blocks and samples its
    first token from the same logits row, with its own parameters and generator."""

    request_id: str
    sampling_params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    grammar: TokenGrammar | None = None


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: list[int]
    needs_sample: bool  # the chunk reaches the end of the sequence, so a new token is sampled
    sampling_params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]  # for the repetition penalty
    output_token_ids: list[int]  # tokens generated so far (for penalties)
    forks: list[ForkedSample] = field(default_factory=list)  # sampled from this request's row, this step
    grammar: TokenGrammar | None = None  # structured output: masks this request's logits row
    num_beam_candidates: int = 0  # a beam: report this many best next tokens instead of sampling one

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): copy-on-write, before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
