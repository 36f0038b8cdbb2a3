"""The runner's side of speculative decoding: score a request's k drafts from the k + 1 logits rows
its chunk produced, with the same penalties, bias, temperature and filters as ordinary sampling (each
row sees the drafts before it as generated tokens), and keep what the rejection sampler accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from folio.outputs import TokenLogprob
from folio.sample.logprobs import gather_logprobs
from folio.sample.sampler import SamplingBatch, adjust_logits, row_problems, sampling_probs
from folio.spec_decode.rejection_sampler import verify_greedy, verify_sampled

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
