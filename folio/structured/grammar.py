"""Per-request grammar state (llguidance matchers) and the batched token masks they produce.

A request's `TokenGrammar` advances with every token it accepts; before each step the scheduler asks
every constrained row for the tokens its grammar allows next, as a bitmask, and the runner sets the
rest to -inf. Masks are computed in parallel across rows by llguidance's executor (it releases the GIL).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import llguidance
import torch

from folio.loaders.tokenizer import Tokenizer
from folio.structured.params import StructuredOutputParams

logger = logging.getLogger("folio")


class TokenGrammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refused it (it cannot go on)."""
        if self.matcher.consume_token(token_id):
            return True
        logger.warning("grammar refused token %d: %s", token_id, self.matcher.get_error())
        return False

    @property
    def is_finished(self) -> bool:
        """The grammar allows no further token (it consumed an EOS, or its language ends here)."""
        return self.matcher.is_stopped()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept from here (its state unchanged)."""
        if not token_ids:
            return 0
        try:
            return self.matcher.validate_tokens(token_ids)
        except Exception:  # a matcher in error: it takes no draft, and its own mask fails the request
            logger.exception("validating draft tokens against a grammar failed")
            return 0

    def draft_masks(self, draft_ids: list[int], vocab_size: int) -> torch.Tensor:
        """[len(draft_ids) + 1, words] bitmasks: what may come next here, and after each draft in turn
        (the rows a speculative verification samples from). The grammar's state is left unchanged;
        every draft must be one it accepts (see valid_prefix)."""
        rows = []
        consumed = 0
        try:
            for token in [*draft_ids, None]:
                rows.append(fill_bitmask([self], vocab_size))
                if token is None:
                    break
                if not self.matcher.consume_token(token):
                    raise ValueError(f"the grammar refused draft token {token}: {self.matcher.get_error()}")
                consumed += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return torch.cat(rows)


class GrammarCompiler:
    """Turns StructuredOutputParams into TokenGrammars for one tokenizer. The tokenizer's llguidance
    index takes a fraction of a second to build, so it is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)

    @cached_property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(
            self.tokenizer.backend.to_str(),
            n_vocab=self.vocab_size,
            eos_token=sorted(self.tokenizer.eos_token_ids) or None,
        )

    def compile(self, params: StructuredOutputParams) -> TokenGrammar:
        matcher = llguidance.LLMatcher(self.lltokenizer, params.compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {params.kind}: {matcher.get_error()}")
        return TokenGrammar(matcher)


@dataclass
class MaskTiming:
    """Time spent computing token masks, for the structured-output benchmark."""

    num_masks: int = 0  # rows masked
    num_steps: int = 0  # sampling steps with at least one masked row
    seconds: float = 0.0


def allowed_tokens(
    grammars: Sequence[TokenGrammar | None], vocab_size: int, timing: MaskTiming | None = None
) -> torch.Tensor | None:
    """[N, vocab_size] bool: which tokens each row's grammar allows next (all, for rows without one);
    None when no row has a grammar."""
    if all(g is None for g in grammars):
        return None
    return unpack_bitmask(fill_bitmask(grammars, vocab_size, timing), vocab_size)


def fill_bitmask(
    grammars: Sequence[TokenGrammar | None], vocab_size: int, timing: MaskTiming | None = None
) -> torch.Tensor:
    """[N, ceil(vocab_size / 32)] int32, bit t of a row set when its grammar allows token t next (every
    bit set for rows without a grammar). Rows are computed in parallel by llguidance's executor."""
    start = time.perf_counter()
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(grammars), words), -1, dtype=torch.int32)  # all bits set: allowed
    rows = [(g.matcher, row) for row, g in enumerate(grammars) if g is not None]
    if rows:
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing torch.compile machinery.
        _executor().unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, len(grammars))
    if timing is not None and rows:
        timing.num_masks += len(rows)
        timing.num_steps += 1
        timing.seconds += time.perf_counter() - start
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, words] int32 -> [N, vocab_size] bool."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """One executor (its thread pool) for every compiler."""
    return llguidance.LLExecutor()
