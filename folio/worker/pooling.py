"""Embedding requests on the runner's side: their prompt's final hidden states (after the model's final
norm; the LM head never runs on them) pooled into one vector when the prompt has been computed.

Each step's chunk of an embedding request is a `PoolSpan` (its rows in the flat batch). Last-token
pooling reads one row, in the step that computes the prompt's last token. Mean pooling reads every
row, so it spans chunked-prefill steps: the runner keeps a running sum per request (on its
`RequestState`, so it goes when the request does). A chunk at position 0 restarts the sum: a mean-
pooling request never takes prefix-cache hits, so its prompt is always computed from there, the
first time and after a preemption alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from folio.sampling_params import PoolingParams
from folio.worker.request_states import RequestState, RequestStates, RunningSum


@dataclass(frozen=True)
class PoolSpan:
    """One embedding request's chunk in a step: rows [first_row, end_row) of the flat batch."""

    first_row: int
    end_row: int
    start_position: int  # the chunk's first prompt position
    ends_prompt: bool  # the chunk computes the prompt's last token: the vector is done this step
    params: PoolingParams

    @property
    def mean(self) -> bool:
        return self.params.method != "last"  # the engine resolves the method; unresolved reads every row

    @property
    def rows(self) -> range:
        """The rows whose hidden states this chunk's pooling reads."""
        if self.mean:
            return range(self.first_row, self.end_row)
        return range(self.end_row - 1, self.end_row) if self.ends_prompt else range(0)


def pool_embeddings(
    hidden: torch.Tensor, spans: dict[str, PoolSpan], states: RequestStates
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The vectors of the embedding requests whose prompt ended this step ([hidden] float32 on the CPU),
    and the requests that failed (non-finite hidden states), by request id. `hidden`: the step's [T,
    hidden] final hidden states."""
    embeddings: dict[str, torch.Tensor] = {}
    failed: dict[str, str] = {}
    for request_id, span in spans.items():
        state = states[request_id]
        if span.mean:
            _accumulate(hidden, span, state)
        if not span.ends_prompt:
            continue
        if span.mean:
            seen, state.pool_sum = state.pool_sum, None
            if seen is None or seen.count != state.num_prompt_tokens:  # never: the scheduler's guard
                failed[request_id] = "the embedding did not see every prompt token"
                continue
            vector = seen.total / seen.count
        else:
            vector = hidden[span.end_row - 1].float()
        if not bool(torch.isfinite(vector).all()):
            failed[request_id] = "the model's hidden states were not finite"
            continue
        embeddings[request_id] = (F.normalize(vector, dim=0) if span.params.normalize else vector).cpu()
    return embeddings, failed


def _accumulate(hidden: torch.Tensor, span: PoolSpan, state: RequestState) -> None:
    rows = hidden[span.first_row : span.end_row]
    if span.start_position == 0 or state.pool_sum is None:
        state.pool_sum = RunningSum(torch.zeros(rows.shape[-1], dtype=torch.float32, device=rows.device), 0)
    state.pool_sum.add(rows)
