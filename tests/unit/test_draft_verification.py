"""The runner's draft verification: plain greedy rows skip the sampling machinery, and must keep
exactly what the full path keeps; a row that is not finite fails the request on either path."""

from __future__ import annotations

import dataclasses

import torch

from folio.sampling_params import SamplingParams
from folio.spec_decode.verification import verify_drafts
from folio.worker.request_states import RequestState


def _state(params: SamplingParams, drafts: list[int]) -> RequestState:
    return RequestState("r", 5, [1, 2, 3, 4, 5, 6, *drafts], params, None, [])


def test_plain_greedy_keeps_what_the_full_path_keeps():
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(5, 50, generator=generator)
        best = logits.argmax(dim=-1).tolist()
        wrong_from = trial % 5
        drafts = [t if j < wrong_from else (t + 1) % 50 for j, t in enumerate(best[:4])]
        plain = SamplingParams(temperature=0, max_tokens=20)
        full = dataclasses.replace(plain, logprobs=0)  # asks for logprobs: the full path
        fast = verify_drafts(logits, _state(plain, drafts), drafts)
        slow = verify_drafts(logits, _state(full, drafts), drafts)
        assert fast.token_ids == slow.token_ids == best[: min(wrong_from, 4) + 1]
        assert fast.target_choices == slow.target_choices == best
        assert fast.problem is None and slow.logprobs is not None


def test_a_row_that_is_not_finite_fails_the_request():
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    drafts = [logits[0].argmax().item(), 0]
    verified = verify_drafts(logits, _state(SamplingParams(temperature=0), drafts), drafts)
    assert verified.problem is not None and verified.token_ids == []
