"""Runs the same prompts through a single-process engine and a split one and measures how far apart
they are: greedy tokens, and every logprob both report (the sampled tokens' top alternatives and the
prompt's), which is the logits up to the log-softmax's shift."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from folio import LLM, SamplingParams
from folio.outputs import RequestOutput
from folio.structured.params import StructuredOutputParams

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


def sample_both(model, prompts, params, split_kwargs: dict, reference_params=None, **kwargs) -> tuple[list, list]:
    """Every sample's token ids, [request][sample], on one process and split (`kwargs` for both;
    `reference_params`: the reference's, when it must take another path to the same tokens)."""
    reference = LLM(model, **kwargs).generate(prompts, reference_params or params, use_tqdm=False)
    split = LLM(model, **kwargs, **split_kwargs)
    try:
        got = split.generate(prompts, params, use_tqdm=False)
    finally:
        split.close()
    return [[o.token_ids for o in r.outputs] for r in reference], [[o.token_ids for o in r.outputs] for r in got]


@contextmanager
def starting_no_rank():
    """The block must start no process (a split refused before any rank starts)."""
    before = len(psutil.Process().children(recursive=True))
    yield
    assert len(psutil.Process().children(recursive=True)) == before


def run_both(model, prompts, params: SamplingParams = GREEDY, split_kwargs: dict | None = None, **kwargs) -> Comparison:
    """`kwargs` for both engines; `split_kwargs` (tensor_parallel_size=2 by default) for the split one."""
    reference = LLM(model, **kwargs).generate(prompts, params, use_tqdm=False)
    split = LLM(model, **kwargs, **(split_kwargs or {"tensor_parallel_size": 2}))
    try:
        outputs = split.generate(prompts, params, use_tqdm=False)
    finally:
        split.close()
    return compare(reference, outputs)


PROPERTIES = {"city": {"enum": ["Paris", "London", "Rome"]}, "capital": {"type": "boolean"}}
SCHEMA = {"type": "object", "properties": PROPERTIES, "required": list(PROPERTIES), "additionalProperties": False}


def structured_with_speculation(model, split_kwargs: dict) -> tuple[list[list[int]], list[list[int]], str]:
    """A JSON-schema request and a repetitive one (drafted by prompt lookup) on one process and split:
    (the reference's tokens, the split model's tokens, the split model's JSON text)."""
    params = [
        SamplingParams(max_tokens=120, temperature=0, structured_output=StructuredOutputParams(json=SCHEMA)),
        SamplingParams(max_tokens=40, temperature=0, logprobs=2),
    ]
    prompts = ["Describe Paris as JSON:", "Repeat after me: one two three four five, one two three four five, one"]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    reference = LLM(model, kv_cache_memory="64MiB").generate(prompts, params, use_tqdm=False)
    split = LLM(model, kv_cache_memory="64MiB", speculative_config=spec, **split_kwargs)
    try:
        got = split.generate(prompts, params, use_tqdm=False)
    finally:
        split.close()
    tokens = [r.outputs[0].token_ids for r in reference], [r.outputs[0].token_ids for r in got]
    return tokens[0], tokens[1], got[0].outputs[0].text
