"""Draft-model speculation changes speed, never outputs: a target drafted by a second model with the
same vocabulary (a copy of itself, which reads the context's K/V from the target's cache, or a
different tiny model, whose drafts are mostly rejected) gives the greedy
tokens and logprobs of the target alone under whole, chunked and preempting schedules, and the draft's
own KV blocks all come back. The case the method exists for: SmolLM2's GGUF file served dense and
drafted by the same file kept 4-bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from folio import LLM, SamplingParams
from folio.config import SpeculativeConfig
from folio.engine.engine_core import EngineCore
from folio.loaders.model_loader import load_model
from folio.spec_decode.draft_model import DraftModelProposer
from tests.speculation import SCHEDULES, assert_same_greedy, repeating_prompts, run_waves, speculating_engine
from tests.tiny_models import VOCAB, make_tiny_model

SPEC = SpeculativeConfig("draft", 3, draft_model="(loaded by the test)")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    def load(kind: str):
        return load_model(make_tiny_model(kind, tmp_path_factory.mktemp(kind)), torch.float32, torch.device("cpu"))

    return {kind: load(kind) for kind in ("llama", "gemma3", "mqa")}


def _engine(target, draft, schedule: str) -> EngineCore:
    return speculating_engine(target, schedule, SPEC if draft is not None else None,
                              draft.model if draft is not None else None)  # fmt: skip


# (target, draft): the target drafting for itself (from a fresh copy, so nothing is shared), and a
# different model whose drafts are mostly wrong.
PAIRS = [("llama", "llama"), ("gemma3", "gemma3"), ("llama", "mqa")]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_greedy_tokens_and_logprobs_equal_the_target_alone(tiny_models, tmp_path, pair, schedule):
    target_kind, draft_kind = pair
    target = tiny_models[target_kind]
    folder = make_tiny_model(draft_kind, tmp_path / draft_kind)
    draft = load_model(folder, torch.float32, torch.device("cpu"))
    prompts = repeating_prompts(4, (16, 8, 20), repeats=1)
    plain = run_waves(_engine(target, None, "whole"), [prompts])
    engine = _engine(target, draft, schedule)
    assert_same_greedy(plain, run_waves(engine, [prompts]))
    stats = engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if target_kind == draft_kind:
        assert stats.acceptance_rate > 0.9  # the same weights draft what the target would say
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    proposer = engine.runner.proposer
    assert isinstance(proposer, DraftModelProposer)
    # The same model in another copy reads the context's K/V from the target's cache; another model
    # computes its own.
    assert (proposer.target_kv is not None) == (target_kind == draft_kind)
    assert proposer.pool.num_free_blocks == proposer.pool.num_blocks and not proposer.sequences
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_models):
    target, draft = tiny_models["llama"], tiny_models["mqa"]
    other = dataclasses.replace(draft.config, vocab_size=VOCAB + 64)
    original = draft.model.config
    draft.model.config = other
    try:
        with pytest.raises(ValueError, match="vocabulary"):
            _engine(target, draft, "whole")
    finally:
        draft.model.config = original


def test_draft_method_and_draft_model_go_together():
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="draft model"):
        SpeculativeConfig("ngram", draft_model="m")


COPYING = [
    "Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\nRepeated: apple, banana,",
    "Write a short story about a robot who learns to paint.",
]


def test_smollm2_served_dense_and_drafted_by_its_own_4_bit_file(smollm2_gguf):
    """The GGUF file's weights dequantized (the target) drafted by the same file kept 4-bit: the
    target's own greedy outputs, with nearly every draft accepted."""
    dense = LLM(smollm2_gguf, quantization="none", kv_cache_memory="64MiB")
    drafted = LLM(smollm2_gguf, quantization="none", kv_cache_memory="64MiB",
                  speculative_config={"method": "draft", "draft_model": str(smollm2_gguf),
                                      "num_speculative_tokens": 5})  # fmt: skip
    assert drafted.draft is not None and drafted.draft.quantization != "none"
    cases = [
        SamplingParams(max_tokens=40, temperature=0),
        SamplingParams(max_tokens=30, temperature=0, n=2, stop=[" grape"], logprobs=1),
    ]
    for params in cases:
        plain = dense.generate(COPYING, params, use_tqdm=False)
        fast = drafted.generate(COPYING, params, use_tqdm=False)
        for a, b in zip(plain, fast, strict=True):
            assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
            assert [o.finish_reason for o in b.outputs] == [o.finish_reason for o in a.outputs]
    stats = drafted.engine.scheduler.spec_stats
    assert stats.acceptance_rate > 0.8 and stats.mean_accepted_length > 3
