"""Samples a step's rows so that one row's fault fails that row only, never its batch.

Masks, penalties and draws are batched over rows, so one row's bad state (a parameter the tensors
cannot hold) would otherwise raise for every request in the step. The batched
path runs first; if it raises, every row is sampled alone, seeded generators rewound first so each row
draws exactly what it would have drawn, and the rows that still raise are reported as failed. A row
whose logits are not finite, or whose masks leave no token, fails too: its draw would mean nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from folio.outputs import TokenLogprob
from folio.sample.sampler import SamplingBatch, sample
from folio.sampling_params import SamplingParams

logger = logging.getLogger("folio")


@dataclass
class SampleSpec:
    """What sampling one row needs (a fork's row repeats its parent's logits)."""

    sampling_params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_beam_candidates: int = 0
    allowed: torch.Tensor | None = None  # [V] bool: the tokens its grammar allows (None: any)


@dataclass
class SampledRows:
    token_ids: list[int]  # per row; meaningless for failed rows
    logprobs: list[TokenLogprob | None]  # per row; None where a row asked for none
    failures: dict[int, str]  # row -> what failed, in words fit for the client


def sample_rows(logits: torch.Tensor, specs: list[SampleSpec]) -> SampledRows:
    """logits [N, V] (N == len(specs)) -> one token per row; faulty rows fail alone."""
    states = [spec.generator.get_state() if spec.generator is not None else None for spec in specs]
    try:
        return _sample(logits, specs)
    except Exception:
        logger.exception("sampling a batch of %d rows failed; sampling each row alone", len(specs))
    for spec, state in zip(specs, states, strict=True):
        if spec.generator is not None and state is not None:
            spec.generator.set_state(state)
    result = SampledRows([], [], {})
    for row, spec in enumerate(specs):
        try:
            one = _sample(logits[row : row + 1], [spec])
        except Exception:
            logger.exception("sampling failed for one row; failing that request only")
            one = SampledRows([0], [None], {0: "sampling failed"})
        result.token_ids.extend(one.token_ids)
        result.logprobs.extend(one.logprobs)
        if 0 in one.failures:
            result.failures[row] = one.failures[0]
    return result


def _sample(logits: torch.Tensor, specs: list[SampleSpec]) -> SampledRows:
    vocab_size = logits.shape[-1]
    allowed = None
    if any(s.allowed is not None for s in specs):
        every = torch.ones(vocab_size, dtype=torch.bool)
        allowed = torch.stack([s.allowed if s.allowed is not None else every for s in specs])
    batch = SamplingBatch.from_params(
        [s.sampling_params for s in specs],
        [s.generator for s in specs],
        prompt_token_ids=[s.prompt_token_ids for s in specs],
        output_token_ids=[s.output_token_ids for s in specs],
        vocab_size=vocab_size,
        allowed=allowed,
    )
    out = sample(logits, batch)
    failures = {row: problem for row, problem in enumerate(out.problems) if problem is not None}
    return SampledRows(out.token_ids.tolist(), out.logprobs, failures)
