"""Turns the logits of one step into tokens: penalties, greedy, temperature, top-k, top-p, min-p,
per-request seeds, and the logprobs a request asked for.

All filtering is batched over rows; only the random draw is per row, so that a request with a seed
draws from its own generator and gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from folio.layers.split_argmax import nonfinite_rows, rows_without_finite
from folio.outputs import TokenLogprob
from folio.sample.logprobs import gather_logprobs
from folio.sample.penalties import PenaltyBatch
from folio.sample.race import race_dense, race_kept, race_whole_rows
from folio.sample.top_k_top_p import top_k_top_p_kept
from folio.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors."""

    temperature: torch.Tensor  # [N] (0 rows are greedy)
    top_k: torch.Tensor  # [N] (0 = off)
    top_p: torch.Tensor  # [N]
    min_p: torch.Tensor  # [N]
    generators: list[torch.Generator | None]
    all_greedy: bool
    penalties: PenaltyBatch | None = None  # None when no row has a penalty
    num_logprobs: tuple[int | None, ...] = ()  # per row; empty when no row wants logprobs
    logit_bias: list[dict[int, float]] | None = None  # per row; None when no row has a bias
    allowed: torch.Tensor | None = None  # [N, V] bool: structured output's token masks; None if no row has one

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        vocab_size: int | None = None,
        allowed: torch.Tensor | None = None,
    ) -> SamplingBatch:
        penalties = None
        if any(p.has_penalties for p in params):
            if prompt_token_ids is None or output_token_ids is None or vocab_size is None:
                raise ValueError("penalties need each row's prompt and output token ids and the vocabulary size")
            penalties = PenaltyBatch.build(params, prompt_token_ids, output_token_ids, vocab_size)
        num_logprobs = tuple(p.logprobs for p in params) if any(p.logprobs is not None for p in params) else ()
        logit_bias = [p.logit_bias for p in params] if any(p.logit_bias for p in params) else None
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            generators=list(generators),
            all_greedy=all(p.greedy for p in params),
            penalties=penalties,
            num_logprobs=num_logprobs,
            logit_bias=logit_bias,
            allowed=allowed,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N]
    logprobs: list[TokenLogprob | None]  # per row; None where a row asked for none
    problems: list[str | None]  # per row: why its token is meaningless (None: the token is good)


def apply_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens less likely than min_p times the row's best."""
    if not bool(batch.min_p.gt(0).any()):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus / min-p set."""
    logits = apply_min_p(logits, batch)
    kept = top_k_top_p_kept(logits, batch.top_k, batch.top_p)
    return logits if kept is None else logits.masked_fill(~kept.mask(logits.shape[-1]), float("-inf"))


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 (penalties, bias and masks applied) -> the distribution each row draws
    from: temperature, then min-p, top-k and top-p (greedy rows are left at temperature 1)."""
    greedy_rows = batch.temperature == 0
    temperature = torch.where(greedy_rows, 1.0, batch.temperature).unsqueeze(1)
    return apply_top_k_top_p_min_p(logits / temperature, batch).softmax(dim=-1)


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 (penalties already applied) -> token ids [N]."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    greedy_rows = batch.temperature == 0
    temperature = torch.where(greedy_rows, 1.0, batch.temperature).unsqueeze(1)
    scaled = apply_min_p(logits / temperature, batch)
    # Greedy rows take the argmax whatever their filters, so they need no prefix.
    top_k = batch.top_k.masked_fill(greedy_rows, 0)
    top_p = batch.top_p.masked_fill(greedy_rows, 1.0)
    kept = top_k_top_p_kept(scaled, top_k, top_p)
    racing = ~greedy_rows
    by_prefix = torch.zeros_like(racing) if kept is None else kept.filters.clone()
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    if bool(greedy_rows.any()):  # a full pass over the vocabulary: only for the rows that need it
        tokens[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
    if kept is not None and kept.wide_rows:  # a nucleus wider than its prefix: one race over the masked row
        wide = list(kept.wide_rows)
        masked = scaled[wide].masked_fill_(~kept.wide_mask, float("-inf"))
        tokens[wide] = race_dense(masked, [batch.generators[row] for row in wide])
        by_prefix[wide] = False
        racing[wide] = False
    whole_rows = (racing & ~by_prefix).nonzero().flatten().tolist()
    if whole_rows:
        tokens[whole_rows] = torch.tensor(race_whole_rows(scaled, whole_rows, batch.generators))
    prefix_rows = (racing & by_prefix).nonzero().flatten().tolist()
    if kept is not None and prefix_rows:
        tokens[prefix_rows] = torch.tensor(race_kept(scaled, kept, prefix_rows, batch.generators))
    return tokens


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Raw logits [N, V] with penalties, logit_bias and the structured-output masks applied."""
    adjusted = batch.penalties.apply(logits) if batch.penalties is not None else logits
    if batch.logit_bias is not None:
        adjusted = _add_logit_bias(adjusted, batch.logit_bias)
    if batch.allowed is not None:  # after penalties and bias, so that nothing can revive a banned token
        adjusted = adjusted.masked_fill(~batch.allowed, float("-inf"))
    return adjusted


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Raw logits [N, V] -> the next token of each row, with logprobs where asked."""
    adjusted = adjust_logits(logits, batch)
    tokens = sample_tokens(adjusted, batch)
    logprobs = gather_logprobs(logits, tokens, batch.num_logprobs) if batch.num_logprobs else [None] * len(tokens)
    return SamplerOutput(tokens, logprobs, row_problems(logits, adjusted))


def row_problems(logits: torch.Tensor, adjusted: torch.Tensor) -> list[str | None]:
    """Rows whose draw means nothing: the model's logits hold NaN or infinity (argmax of NaN is
    arbitrary), or the masks left no token with a finite logit."""
    not_finite = nonfinite_rows(logits)
    # A row with no finite logit has a non-finite one: when nothing adjusted them, that says it all.
    none_left = torch.zeros_like(not_finite) if adjusted is logits else rows_without_finite(adjusted)
    if not bool((not_finite | none_left).any()):
        return [None] * logits.shape[0]
    return [
        "the model's logits were not finite" if bad else "no token was allowed" if empty else None
        for bad, empty in zip(not_finite.tolist(), none_left.tolist(), strict=True)
    ]


def _add_logit_bias(logits: torch.Tensor, biases: list[dict[int, float]]) -> torch.Tensor:
    rows = [row for row, bias in enumerate(biases) for _ in bias]
    ids = [token for bias in biases for token in bias]
    values = [value for bias in biases for value in bias.values()]
    logits = logits.clone()
    logits[rows, ids] += torch.tensor(values, dtype=logits.dtype)
    return logits
