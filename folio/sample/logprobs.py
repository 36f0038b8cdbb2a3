"""Log-probabilities returned with sampled tokens (OpenAI `logprobs` / `top_logprobs`).

They come from the model's raw distribution, before penalties, temperature and top-k/p filters, as
vLLM does by default: they describe what the model thinks, not how the sampler was configured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from folio.outputs import TokenLogprob
from folio.step import BeamCandidates


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """logits [N, V], token_ids [N]; num_top[i] is None for rows that asked for no logprobs."""
    wanted = [row for row, k in enumerate(num_top) if k is not None]
    if not wanted:
        return [None] * len(num_top)
    rows = torch.tensor(wanted)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
    k_max = max(num_top[r] or 0 for r in wanted)
    top_values, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (logprobs[:, :0], rows[:, None][:, :0])
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result: list[TokenLogprob | None] = [None] * len(num_top)
    for i, row in enumerate(wanted):
        k = num_top[row] or 0
        top = list(zip(top_ids[i][:k], top_values[i][:k], strict=True))
        result[row] = TokenLogprob(int(token_ids[row]), chosen[i], top)
    return result


# A beam's best next tokens come from its logits row in the same way, instead of a sample.
def top_candidates(logits: torch.Tensor, k: int) -> list[BeamCandidates]:
    """Rows of raw logits [N, V] -> each row's k most likely next tokens by log-softmax."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return [BeamCandidates(v, i) for v, i in zip(values, ids, strict=True)]
