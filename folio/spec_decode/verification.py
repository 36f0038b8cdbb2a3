"""The runner's side of speculative decoding: score a request's k drafts from the k + 1 logits rows
its chunk produced, with the same penalties, bias, temperature and filters as ordinary sampling (each
row sees the drafts before it as generated tokens), and keep what the rejection sampler accepts, so
that its outputs are exactly the target's (Leviathan et al. 2023; Chen et al. 2023).

The rejection sampler: rows 0..k of `target_probs` are the target's distributions (penalties, bias,
masks, temperature and top-k/p/min-p already applied) at the positions where draft j (row j < k) and
the token after the last draft (row k) are chosen. Greedy: accept drafts while each equals the target's
argmax, then add the argmax where they part (or after the last draft). Sampling: accept draft j with
probability min(1, p(x)/q(x)); at the first rejection draw from the residual max(0, p - q)
renormalised; if every draft is accepted, draw the bonus token from p. A proposer without a
distribution (prompt lookup) has q one-hot on its draft, so acceptance is p(x) and the residual is p
without x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from folio.outputs import TokenLogprob
from folio.sample.logprobs import gather_logprobs
from folio.sample.race import exponential_rows
from folio.sample.sampler import SamplingBatch, adjust_logits, row_problems, sampling_probs

if TYPE_CHECKING:  # the runner's state of a request, read here, never built
    from folio.worker.request_states import RequestState


@dataclass
class Verified:
    token_ids: list[int]  # the accepted drafts, then the target's own next token
    logprobs: list[TokenLogprob] | None  # one per token, where the request asked
    target_choices: list[int]  # the target's greedy token at each of the k + 1 rows (lookahead learns from them)
    problem: str | None = None  # set: the rows cannot be trusted; the request fails


def verify_greedy_choices(choices: list[int], draft_ids: list[int]) -> Verified:
    """A plain-greedy request's drafts from the target's argmax at each row (`choices`, k + 1 of them)."""
    return Verified(verify_greedy(choices, draft_ids), None, choices)


def verify_drafts(
    logits: torch.Tensor, state: RequestState, draft_ids: list[int], allowed: torch.Tensor | None = None
) -> Verified:
    """logits [k + 1, V] (raw, float) at the positions of the last token and each draft; `allowed`
    [k + 1, V]: structured output's masks at those rows (the drafts were cut to what the grammar takes)."""
    params = state.sampling_params
    if params.plain_greedy and allowed is None and bool(torch.isfinite(logits.sum())):  # one pass: see row_problems
        # Nothing adjusts these rows (filters keep the argmax): the target's choices are the raw argmax.
        return verify_greedy_choices(logits.argmax(dim=-1).tolist(), draft_ids)
    k = len(draft_ids)
    confirmed = state.output_token_ids[: len(state.output_token_ids) - k]  # before this step's drafts
    batch = SamplingBatch.from_params(
        [params] * (k + 1),
        [state.generator] * (k + 1),
        prompt_token_ids=[state.prompt_token_ids] * (k + 1),
        output_token_ids=[confirmed + draft_ids[:j] for j in range(k + 1)],
        vocab_size=logits.shape[-1],
        allowed=allowed,
    )
    adjusted = adjust_logits(logits, batch)
    problems = [p for p in row_problems(logits, adjusted) if p is not None]
    if problems:
        return Verified([], None, [], problems[0])
    choices = adjusted.argmax(dim=-1).tolist()
    if params.greedy:
        tokens = verify_greedy(choices, draft_ids)
    else:
        tokens = verify_sampled(sampling_probs(adjusted, batch), draft_ids, None, state.generator)
    logprobs = None
    if params.logprobs is not None:  # the target's, at each kept token's own position
        found = gather_logprobs(logits[: len(tokens)], torch.tensor(tokens), [params.logprobs] * len(tokens))
        logprobs = [lp for lp in found if lp is not None]
    return Verified(tokens, logprobs, choices)


def verify_greedy(target_argmax: list[int], draft_ids: list[int]) -> list[int]:
    """The accepted drafts followed by the target's own next token."""
    accepted = []
    for draft, best in zip(draft_ids, target_argmax, strict=False):
        if draft != best:
            break
        accepted.append(draft)
    return [*accepted, target_argmax[len(accepted)]]


def verify_sampled(
    target_probs: torch.Tensor,
    draft_ids: list[int],
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """target_probs [k + 1, V], draft_probs [k, V] or None (one-hot drafts) -> accepted drafts + one."""
    k = len(draft_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} target rows, got {target_probs.shape[0]}")
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64) if k else torch.empty(0)
    accepted: list[int] = []
    for j, draft in enumerate(draft_ids):
        p = float(target_probs[j, draft])
        q = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if q > 0 and float(uniforms[j]) < min(1.0, p / q):
            accepted.append(draft)
            continue
        if draft_probs is None:
            residual = target_probs[j].clone()
            residual[draft] = 0.0
        else:
            residual = (target_probs[j] - draft_probs[j]).clamp(min=0.0)
        return [*accepted, _draw(residual, target_probs[j], generator)]
    return [*accepted, _draw(target_probs[k], target_probs[k], generator)]


def _draw(weights: torch.Tensor, fallback: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to `weights` (an exponential race, as the sampler
    draws); if they sum to nothing (p and q agree exactly there), from `fallback`."""
    if not bool((weights > 0).any()):
        weights = fallback
    noise = exponential_rows(weights.shape[-1], [generator])[0]
    return int((weights.float() / noise).argmax())
