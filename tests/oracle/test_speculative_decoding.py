"""Speculative decoding changes speed, never outputs: with prompt lookup, greedy tokens and logprobs
equal the run without it for every architecture's tiny model under whole, chunked and preempting
schedules, and for SmolLM2 with n > 1, stop strings, structured output and prefix caching; sampled
tokens keep the target's distribution. Suffix, lookahead and draft-model speculation keep every
architecture's greedy outputs too; both real models are checked."""

from __future__ import annotations

import collections
import math

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
    """Seeded samples of the 2nd and 3rd tokens (drafted and verified: batches of 8 keep speculation on),
    against the target's own distribution of each given the tokens before it (the plain engine's logprobs
    at temperature 1). Each sample falls in a bucket: the rank of its token among its context's five
    likeliest, or the rest; the expected share of each bucket is its probability averaged over the samples'
    contexts. Against the exact distribution rather than a second sampled run, 480 samples are as sure as
    960 against 960 were."""
    prompt = "Count: one, two, three, one, two, three, one, two,"
    n = 480
    before = speculating_llm.engine.scheduler.spec_stats.num_draft_tokens
    samples, prompt_ids = [], []
    for start in range(0, n, 8):
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
                  for s in range(start, start + 8)]  # fmt: skip
        for out in speculating_llm.generate([prompt] * 8, params, use_tqdm=False):
            samples.append(tuple(out.outputs[0].token_ids))
            prompt_ids = out.prompt_token_ids
    assert speculating_llm.engine.scheduler.spec_stats.num_draft_tokens > before

    contexts = sorted({sample[:position] for sample in samples for position in (1, 2)})
    params = SamplingParams(max_tokens=1, temperature=1.0, logprobs=5, seed=0)
    outputs = offline_llm.generate([prompt_ids + list(c) for c in contexts], params, use_tqdm=False)
    likeliest = {c: out.outputs[0].logprobs[0].top for c, out in zip(contexts, outputs, strict=True)}
    for position in (1, 2):  # the 2nd and 3rd tokens
        observed, expected = [0] * 6, [0.0] * 6
        for sample in samples:
            top = likeliest[sample[:position]]
            ranks = [token for token, _ in top]
            observed[ranks.index(sample[position]) if sample[position] in ranks else 5] += 1
            for rank, (_, logprob) in enumerate(top):
                expected[rank] += math.exp(logprob)
            expected[5] += 1 - sum(math.exp(logprob) for _, logprob in top)
        tv = sum(abs(o - e) for o, e in zip(observed, expected, strict=True)) / (2 * n)
        assert tv < 0.07, (position, tv, observed, expected)  # ~3 standard deviations of the noise at n = 480


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
