"""Runs the same prompts through a single-process engine and a split one and measures how far apart
they are: greedy tokens, and every logprob both report (the sampled tokens' top alternatives and the
prompt's), which is the logits up to the log-softmax's shift."""

from __future__ import annotations

from dataclasses import dataclass

from folio import LLM, SamplingParams
from folio.outputs import RequestOutput

TINY_PROMPTS = [[1, 5, 9, 33, 7, 100, 200, 3, 17, 61, 2, 90], [4, 4, 8, 15, 16, 23, 42], [250, 12]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=5)


@dataclass
class Comparison:
    same_tokens: bool
    max_logprob_diff: float


def compare(reference: list[RequestOutput], split: list[RequestOutput]) -> Comparison:
    same, worst = True, 0.0
    for ref, got in zip(reference, split, strict=True):
        for a, b in zip(ref.outputs, got.outputs, strict=True):
            same &= a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs or [], b.logprobs or [], strict=False):
                for (ta, pa), (tb, pb) in zip(la.top, lb.top, strict=True):
                    worst = max(worst, abs(pa - pb)) if ta == tb else float("inf")
        for la, lb in zip((ref.prompt_logprobs or [])[1:], (got.prompt_logprobs or [])[1:], strict=True):
            worst = max(worst, abs(la.logprob - lb.logprob))
    return Comparison(same, worst)


def run_both(model, prompts, params: SamplingParams = GREEDY, split_kwargs: dict | None = None, **kwargs) -> Comparison:
    """`kwargs` for both engines; `split_kwargs` (tensor_parallel_size=2 by default) for the split one."""
    reference = LLM(model, **kwargs).generate(prompts, params, use_tqdm=False)
    split = LLM(model, **kwargs, **(split_kwargs or {"tensor_parallel_size": 2}))
    try:
        outputs = split.generate(prompts, params, use_tqdm=False)
    finally:
        split.close()
    return compare(reference, outputs)
