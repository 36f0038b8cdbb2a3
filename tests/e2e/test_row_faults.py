"""A fault in one request's row of a step ends that request with an error; every other request in the
batch finishes exactly as it would have without it, and nothing holds KV afterwards.

Faults are injected per row into the real engine (smollm2): the batched sampler raising, NaN logits,
a grammar whose mask or advance raises, a detokenizer that raises. The victim is marked by top_k=7777.
"""

from __future__ import annotations

import math

import pytest
import torch

from folio import SamplingParams, StructuredOutputParams
from folio.engine import output_processor, structured_output
from folio.sample.sampler import row_problems
from folio.structured import grammar
from folio.worker import model_runner
from tests.faults import MARK, fail_marked_rows_in_the_sampler

STOP_MARK = "\x00never"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]


def _params(victim: SamplingParams) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        victim,
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),  # seeded draws
    ]


def _is_victim(params: SamplingParams) -> bool:
    return params.top_k == MARK


def _nan_logits(monkeypatch):
    real = model_runner.sample_rows

    def sample_rows(logits, specs):
        for row, spec in enumerate(specs):
            if _is_victim(spec.sampling_params):
                logits[row] = math.nan
        return real(logits, specs)

    monkeypatch.setattr(model_runner, "sample_rows", sample_rows)


def _mask_raises(monkeypatch):
    def fill_bitmask(grammars, vocab_size, timing):
        raise RuntimeError("injected grammar fault")

    monkeypatch.setattr(structured_output, "fill_bitmask", fill_bitmask)


def _advance_raises(monkeypatch):
    def accept(self, token_id):
        raise RuntimeError("injected grammar fault")

    monkeypatch.setattr(grammar.TokenGrammar, "accept", accept)


def _detokenizer_raises(monkeypatch):
    real = output_processor.IncrementalDetokenizer.add

    def add(self, token_ids, finished=False):
        if STOP_MARK in self._stop:
            raise RuntimeError("injected detokenizer fault")
        return real(self, token_ids, finished)

    monkeypatch.setattr(output_processor.IncrementalDetokenizer, "add", add)


VICTIM = SamplingParams(max_tokens=10, temperature=0.7, top_k=MARK, seed=3, ignore_eos=True)
CONSTRAINED = SamplingParams(max_tokens=10, temperature=0, top_k=MARK,
                             structured_output=StructuredOutputParams(regex="[a-z ]{1,40}"))  # fmt: skip
WITH_STOP = SamplingParams(max_tokens=10, temperature=0, top_k=MARK, stop=[STOP_MARK], ignore_eos=True)
FAULTS = {
    "sampler raises": (fail_marked_rows_in_the_sampler, VICTIM),
    "NaN logits": (_nan_logits, VICTIM),
    "grammar mask raises": (_mask_raises, CONSTRAINED),
    "grammar advance raises": (_advance_raises, CONSTRAINED),
    "detokenizer raises": (_detokenizer_raises, WITH_STOP),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_row_fails_alone_and_the_batch_is_unchanged(offline_llm, monkeypatch, fault):
    inject, victim = FAULTS[fault]
    clean = offline_llm.generate(PROMPTS, _params(victim), use_tqdm=False)
    inject(monkeypatch)
    faulted = offline_llm.generate(PROMPTS, _params(victim), use_tqdm=False)

    assert faulted[1].outputs[0].finish_reason == "error"
    for before, after in zip(clean[::2], faulted[::2], strict=True):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        assert after.outputs[0].finish_reason == "length"
    pool = offline_llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not offline_llm.engine.has_unfinished()


def test_rows_whose_masks_leave_no_token_are_reported():
    logits = torch.zeros(3, 5)
    logits[1, 2] = math.nan
    adjusted = logits.clone()
    adjusted[2] = -math.inf
    assert row_problems(logits, adjusted) == [None, "the model's logits were not finite", "no token was allowed"]
