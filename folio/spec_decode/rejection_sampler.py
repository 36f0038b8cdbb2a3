"""Verifies a request's draft tokens against the target model so that its outputs are exactly the
target's (Leviathan et al. 2023; Chen et al. 2023).

Rows 0..k of `target_probs` are the target's distributions (penalties, bias, masks, temperature and
top-k/p/min-p already applied) at the positions where draft j (row j < k) and the token after the last
draft (row k) are chosen. Greedy: accept drafts while each equals the target's argmax, then add the
argmax where they part (or after the last draft). Sampling: accept draft j with probability
min(1, p(x)/q(x)); at the first rejection draw from the residual max(0, p - q) renormalised; if every
draft is accepted, draw the bonus token from p. A proposer without a distribution (prompt lookup) has
q one-hot on its draft, so acceptance is p(x) and the residual is p without x.
"""

from __future__ import annotations

import torch

from folio.sample.noise import exponential_rows


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
