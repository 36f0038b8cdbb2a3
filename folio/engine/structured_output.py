"""Structured output on the scheduler's side: grammars advance here, and each step sends the runner
only a bitmask of the tokens every constrained row may sample next (as vLLM's structured-output
manager does), never a live matcher.

One grammar's fault fails its own row only: if the batched mask computation raises, each row is
computed alone, and a row that still raises allows no token, which the sampler reports as that
request's failure.
"""

from __future__ import annotations

import logging

import torch

from folio.step.scheduler_output import GrammarBitmask
from folio.structured.grammar import MaskTiming, TokenGrammar, fill_bitmask

logger = logging.getLogger("folio")


class StructuredOutputManager:
    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size  # the model's logits width; set by the engine
        self.timing = MaskTiming()

    def bitmask(self, rows: list[tuple[str, TokenGrammar]]) -> GrammarBitmask | None:
        """The next-token bitmask of each (request id, grammar) row; None when there are none."""
        if not rows:
            return None
        if self.vocab_size is None:
            raise ValueError("structured output needs the model's vocabulary size")
        grammars = [grammar for _, grammar in rows]
        try:
            bits = grammar_bitmask(grammars, self.vocab_size, self.timing)
        except Exception:
            logger.exception("computing %d grammar masks failed; computing each alone", len(rows))
            bits = torch.cat([self._one_row(grammar) for grammar in grammars])
        return GrammarBitmask(tuple(request_id for request_id, _ in rows), bits)

    def _one_row(self, grammar: TokenGrammar) -> torch.Tensor:
        assert self.vocab_size is not None
        try:
            return grammar_bitmask([grammar], self.vocab_size, self.timing)
        except Exception:
            logger.exception("a grammar failed to compute its mask; that request fails")
            return torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)  # no token allowed


def grammar_bitmask(grammars: list[TokenGrammar], vocab_size: int, timing: MaskTiming) -> torch.Tensor:
    """[len(grammars), ceil(vocab / 32)] int32 bitmask of the tokens each grammar allows next."""
    return fill_bitmask(grammars, vocab_size, timing)
