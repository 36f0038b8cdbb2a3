"""Speculative decoding changes speed, never outputs: with prompt lookup, greedy tokens and logprobs
equal the run without it for every architecture's tiny model under whole, chunked and preempting
schedules, and for SmolLM2 with n > 1, stop strings, structured output and prefix caching; sampled
tokens keep the target's distribution. Suffix, lookahead and draft-model speculation keep every
architecture's greedy outputs too; both real models are checked."""

from __future__ import annotations

import collections

import pytest
import torch

from folio import LLM, SamplingParams, StructuredOutputParams
from folio.config import SpeculativeConfig
from folio.loaders.model_loader import load_model
from tests.speculation import SCHEDULES, assert_same_greedy, repeating_prompts, run_waves, speculating_engine
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS, make_tiny_model

SPEC = SpeculativeConfig(num_speculative_tokens=3)


@pytest.fixture(scope="module", params=TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(folder, torch.float32, torch.device("cpu"))


def _greedy(loaded, schedule: str, speculative: SpeculativeConfig | None, prompts: list[list[int]], draft=None):
    engine = speculating_engine(loaded, schedule, speculative, draft)
    requests = run_waves(engine, [prompts])
    assert len(engine.runner.requests) == 0  # the runner forgot every finished request
    return requests, engine


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tiny_models_greedy_tokens_and_logprobs_equal_without_speculation(tiny, schedule):
    # Prompts that repeat themselves, so prompt lookup finds something to propose.
    prompts = repeating_prompts(3, (10, 2, 6), repeats=4)
    plain, _ = _greedy(tiny, schedule, None, prompts)
    speculated, engine = _greedy(tiny, schedule, SPEC, prompts)
    assert_same_greedy(plain, speculated)
    assert engine.scheduler.spec_stats.num_draft_tokens > 0  # drafts were verified
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0


PROPOSERS = {
    "suffix": SpeculativeConfig("suffix", 3),
    "lookahead": SpeculativeConfig("lookahead", 3),
    "draft": SpeculativeConfig("draft", 3, draft_model="(a second copy of the tiny model)"),
}


@pytest.mark.parametrize("method", sorted(PROPOSERS))
def test_every_proposer_keeps_every_architectures_greedy_outputs(tiny, method):
    """The other proposers on every architecture (their own files cover the schedules): same tokens and
    logprobs as without speculation, with drafts verified."""
    prompts = repeating_prompts(3, (10, 2, 6), repeats=4)
    draft = load_model(tiny.path, torch.float32, torch.device("cpu")).model if method == "draft" else None
    plain, _ = _greedy(tiny, "whole", None, prompts)
    speculated, engine = _greedy(tiny, "whole", PROPOSERS[method], prompts, draft)
    assert_same_greedy(plain, speculated)
    assert engine.scheduler.spec_stats.num_draft_tokens > 0


COPYING = [
    "Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\nRepeated: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def speculating_llm(smollm2_gguf):
    return LLM(smollm2_gguf, speculative_config={"num_speculative_tokens": 4})


def test_smollm2_greedy_outputs_equal_without_speculation(offline_llm, speculating_llm):
    cases = [
        SamplingParams(max_tokens=40, temperature=0),
        SamplingParams(max_tokens=40, temperature=0, n=2, stop=[" grape"], logprobs=1),
        SamplingParams(max_tokens=30, temperature=0, structured_output=StructuredOutputParams(regex="[a-z, ]{5,40}")),
    ]
    for params in cases:
        plain = offline_llm.generate(COPYING, params, use_tqdm=False)
        fast = speculating_llm.generate(COPYING, params, use_tqdm=False)
        for a, b in zip(plain, fast, strict=True):
            assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
            assert [o.text for o in b.outputs] == [o.text for o in a.outputs]
            assert [o.finish_reason for o in b.outputs] == [o.finish_reason for o in a.outputs]
    stats = speculating_llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_draft_tokens < 4 * stats.num_drafts  # rejections shortened some requests' drafts
    pool = speculating_llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # every block came back, rejected drafts' included


def test_sampled_tokens_keep_the_targets_distribution(offline_llm, speculating_llm):
    """Seeded samples of the 2nd and 3rd tokens (drafted and verified) with and without speculation:
    the empirical distributions agree within sampling noise (batches of 8 keep speculation on). They
    are compared over the plain run's five likeliest tokens and the rest together: a long tail of rare
    tokens would otherwise be all noise (two plain runs differ by a TV of ~0.15 over every token)."""
    prompt = "Count: one, two, three, one, two, three, one, two,"
    n = 960

    def samples(llm: LLM) -> tuple[collections.Counter, collections.Counter]:
        second, third = collections.Counter(), collections.Counter()
        for start in range(0, n, 8):
            params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
                      for s in range(start, start + 8)]  # fmt: skip
            for out in llm.generate([prompt] * 8, params, use_tqdm=False):
                second[out.outputs[0].token_ids[1]] += 1
                third[out.outputs[0].token_ids[2]] += 1
        return second, third

    before = speculating_llm.engine.scheduler.spec_stats.num_draft_tokens
    for plain, fast in zip(samples(offline_llm), samples(speculating_llm), strict=True):
        top = [t for t, _ in plain.most_common(5)]
        buckets = [(plain[t], fast[t]) for t in top]
        buckets.append((n - sum(p for p, _ in buckets), n - sum(f for _, f in buckets)))
        tv = sum(abs(p - f) for p, f in buckets) / (2 * n)
        assert tv < 0.07, (tv, buckets)  # ~3 standard deviations of the sampling noise at n = 960
    assert speculating_llm.engine.scheduler.spec_stats.num_draft_tokens > before


def test_structured_output_speculates_within_its_grammar(offline_llm, speculating_llm):
    """A constrained request drafts too: drafts the grammar refuses are cut before verification, each
    verified row is masked by the grammar after the drafts before it, and outputs equal the plain run."""
    prompt = COPYING[0]
    params = SamplingParams(max_tokens=40, temperature=0,
                            structured_output=StructuredOutputParams(regex="( [a-z]+,){3,12}"))  # fmt: skip
    before = speculating_llm.engine.scheduler.spec_stats.num_accepted_tokens
    plain = offline_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    fast = speculating_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    assert speculating_llm.engine.scheduler.spec_stats.num_accepted_tokens > before


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_gemma3_greedy_outputs_equal_without_speculation(gemma3_gguf, method):
    """The second real model (sliding-window layers, QK-norm, no C++ decode step) under both
    model-free proposers: the same greedy tokens, with drafts accepted. Plain greedy drafts are checked
    against the target's argmax rows alone (the 8-bit head's two-stage pick), never its whole logits."""
    plain = LLM(gemma3_gguf, kv_cache_memory="64MiB")
    fast = LLM(gemma3_gguf, kv_cache_memory="64MiB",
               speculative_config={"method": method, "num_speculative_tokens": 4})  # fmt: skip
    runner = fast.engine.runner
    whole_logits = collections.Counter()
    compute_logits = runner.compute_logits
    runner.compute_logits = lambda hidden: whole_logits.update([hidden.shape[0]]) or compute_logits(hidden)
    params = SamplingParams(max_tokens=32, temperature=0)
    for a, b in zip(plain.generate(COPYING[:2], params, use_tqdm=False),
                    fast.generate(COPYING[:2], params, use_tqdm=False), strict=True):  # fmt: skip
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert fast.engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert not whole_logits
