"""A beam's best next tokens, taken from its logits row instead of a sample."""

from __future__ import annotations

import torch

from folio.step.runner_output import BeamCandidates


def top_candidates(logits: torch.Tensor, k: int) -> list[BeamCandidates]:
    """Rows of raw logits [N, V] -> each row's k most likely next tokens by log-softmax."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return [BeamCandidates(v, i) for v, i in zip(values, ids, strict=True)]
