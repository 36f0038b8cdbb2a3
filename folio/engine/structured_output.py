"""Structured output on the scheduler's side: grammars advance here, and each step sends the runner
only a bitmask of the tokens every constrained row may sample next (as vLLM's structured-output
manager does), never a live matcher.

One grammar's fault fails its own row only: if the batched mask computation raises, each row is
computed alone, and a row that still raises allows no token, which the sampler reports as that
request's failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from folio.step import GrammarBitmask
from folio.structured.grammar import MaskTiming, TokenGrammar, fill_bitmask

logger = logging.getLogger("folio")


class StructuredOutputManager:
    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size  # the model's logits width; set by the engine
        self.timing = MaskTiming()

    def bitmask(self, rows: list[tuple[str, TokenGrammar, list[int]]]) -> GrammarBitmask | None:
        """The bitmask of each (request id, grammar, drafts) row: the tokens it may sample next, and for a
        request verifying k drafts, k + 1 rows (after each draft in turn). None when there are none."""
        if not rows:
            return None
        if self.vocab_size is None:
            raise ValueError("structured output needs the model's vocabulary size")
        vocab_size = self.vocab_size
        grammars = [grammar for _, grammar, drafts in rows if not drafts]
        try:
            plain = fill_bitmask(grammars, vocab_size, self.timing) if grammars else None
        except Exception:
            logger.exception("computing %d grammar masks failed; computing each alone", len(grammars))
            plain = torch.cat([self._guarded_rows(1, fill_bitmask, [g], vocab_size, self.timing) for g in grammars])
        request_ids = [request_id for request_id, _, drafts in rows if not drafts]
        parts = [] if plain is None else [plain]
        for request_id, grammar, drafts in rows:
            if drafts:
                parts.append(self._guarded_rows(len(drafts) + 1, grammar.draft_masks, drafts, vocab_size))
                request_ids += [request_id] * (len(drafts) + 1)
        return GrammarBitmask(tuple(request_ids), torch.cat(parts))

    def _guarded_rows(self, num_rows: int, compute: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """`compute(*args)`, one grammar's `num_rows` mask rows; if it raises, rows that allow no token."""
        try:
            return compute(*args)
        except Exception:
            logger.exception("a grammar failed to compute %d mask rows; that request fails", num_rows)
            assert self.vocab_size is not None
            return torch.zeros((num_rows, (self.vocab_size + 31) // 32), dtype=torch.int32)
