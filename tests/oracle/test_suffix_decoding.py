"""SuffixDecoding keeps greedy outputs exactly the model's: tiny models give the same tokens and
logprobs with the suffix proposer as without speculation, whether its drafts come from the request's
own context or (for requests that run after others) from earlier requests' outputs."""

from __future__ import annotations

import pytest
import torch

from folio.config import SpeculativeConfig
from folio.loaders.model_loader import load_model
from tests.speculation import SCHEDULES, assert_same_greedy, repeating_prompts, run_waves, speculating_engine
from tests.tiny_models import make_tiny_model

SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_max_spec_factor=2.0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(folder, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tiny_models_greedy_tokens_and_logprobs_equal_without_speculation(tiny, schedule):
    # A first wave whose prompts repeat themselves (the request's own tree drafts), then a second that
    # asks two of them again and a new one, after the first wave's outputs went to the global tree.
    first = repeating_prompts(3, (10, 2, 6), repeats=4)
    waves = [first, [first[0], repeating_prompts(4, (9,), repeats=1)[0], first[2]]]
    plain = run_waves(speculating_engine(tiny, schedule, None), waves)
    engine = speculating_engine(tiny, schedule, SUFFIX)
    speculated = run_waves(engine, waves)
    assert_same_greedy(plain, speculated)
    assert engine.scheduler.spec_stats.num_draft_tokens > 0  # drafts were verified
    assert len(engine.runner.proposer.cached) == len(first) + len(waves[1])  # every output went to the global tree
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_earlier_outputs_draft_for_a_later_request(tiny):
    """A prompt that does not repeat itself, asked twice in a row: the second time, the first answer
    in the global tree supplies drafts from its first token, which the target then accepts."""
    prompt = repeating_prompts(5, (12,), repeats=1)[0]
    accepted = {}
    for cached in (0, 10):
        config = SpeculativeConfig(method="suffix", suffix_max_cached_requests=cached)
        engine = speculating_engine(tiny, "whole", config)
        (first,) = run_waves(engine, [[prompt]], tag="first")
        before = engine.scheduler.spec_stats.num_accepted_tokens
        (second,) = run_waves(engine, [[prompt]], tag="second")
        assert second.output_token_ids == first.output_token_ids
        accepted[cached] = engine.scheduler.spec_stats.num_accepted_tokens - before
    assert accepted[10] > accepted[0] and accepted[10] >= 12
