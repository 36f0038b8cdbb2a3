"""Presence, frequency and repetition penalties, batched over rows.

Presence and frequency follow OpenAI: `logit -= frequency * count + presence * (count > 0)`, counting
only generated tokens. Repetition follows transformers' RepetitionPenaltyLogitsProcessor: a token seen
in the prompt or the output has a positive logit divided by the penalty and a negative one multiplied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from folio.sampling_params import SamplingParams


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """[N, V] float counts of each token id per row."""
    counts = torch.zeros(len(token_lists), vocab_size + 1)
    width = max((len(t) for t in token_lists), default=0)
    if width:
        # Pad with an extra id (vocab_size) whose column is dropped, so one scatter covers all rows.
        index = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            index[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
    return counts[:, :vocab_size]


@dataclass
class PenaltyBatch:
    presence: torch.Tensor  # [N, 1]
    frequency: torch.Tensor  # [N, 1]
    repetition: torch.Tensor  # [N, 1]
    output_counts: torch.Tensor  # [N, V]
    seen: torch.Tensor  # [N, V] bool: in the prompt or the output

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
    ) -> PenaltyBatch:
        output_counts = _token_counts(output_token_ids, vocab_size)
        needs_prompt = [p.repetition_penalty != 1.0 for p in params]
        prompts = [ids if need else [] for ids, need in zip(prompt_token_ids, needs_prompt, strict=True)]
        seen = (_token_counts(prompts, vocab_size) > 0) | (output_counts > 0)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32).unsqueeze(1)

        return cls(column("presence_penalty"), column("frequency_penalty"), column("repetition_penalty"),
                   output_counts, seen)  # fmt: skip

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, penalised, logits)
        return logits - self.frequency * self.output_counts - self.presence * (self.output_counts > 0).float()
