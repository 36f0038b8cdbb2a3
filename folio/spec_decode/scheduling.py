"""The scheduler's side of speculative decoding: which drafts a request verifies this step, and the
counts /metrics and the benchmarks report (vLLM's spec-decode counters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler's request, read here, never built
    from folio.engine.request import Request


def drafts_to_verify(request: Request, budget: int, max_model_len: int) -> list[int]:
    """The drafts a decoding request verifies this step: as many as the step's budget, its max_tokens
    and the context length leave room for if every one is accepted and the target adds its own, and,
    under structured output, only those its grammar accepts (the target could never produce the rest)."""
    if not request.spec_token_ids or request.num_computed_tokens != request.num_tokens - 1:
        return []
    room = min(
        budget - 1,
        request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
        max_model_len - request.num_tokens - 1,
    )
    drafts = request.spec_token_ids[: max(room, 0)]
    if request.grammar is not None:
        drafts = drafts[: request.grammar.valid_prefix(drafts)]
    return drafts


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications: steps in which a request checked at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
