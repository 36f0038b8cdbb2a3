"""Lookahead decoding keeps greedy outputs exactly the model's: tiny models give the same tokens and
logprobs with the lookahead proposer as without speculation, under whole, chunked and preempting
schedules, and the prompts asked again draft from the first answers in the shared pool; seeded
sampling with it gives a well-formed run."""

from __future__ import annotations

import pytest
import torch

from folio import SamplingParams
from folio.config import SpeculativeConfig
from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.loaders.model_loader import load_model
from tests.speculation import (
    GREEDY,
    SCHEDULES,
    assert_same_greedy,
    repeating_prompts,
    run_waves,
    speculating_engine,
)
from tests.tiny_models import VOCAB, make_tiny_model

LOOKAHEAD = SpeculativeConfig(method="lookahead", num_speculative_tokens=4, lookahead_ngram_size=3)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(folder, torch.float32, torch.device("cpu"))


def _run(loaded, schedule: str, speculative: SpeculativeConfig | None, waves: list[list[list[int]]],
         params: SamplingParams) -> tuple[list[Request], EngineCore]:  # fmt: skip
    engine = speculating_engine(loaded, schedule, speculative)
    return run_waves(engine, waves, params), engine


def _prompts() -> list[list[int]]:
    # Prompts that repeat themselves, as in the prompt lookup test: the pool then holds their n-grams.
    return repeating_prompts(3, (10, 2, 6), repeats=4)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tiny_models_greedy_tokens_and_logprobs_equal_without_speculation(tiny, schedule):
    params = GREEDY
    # A random tiny model's text seldom repeats: the second wave, asking the first's prompts again,
    # drafts from the first wave's outputs (in the shared pool by then), which the target accepts.
    waves = [_prompts(), _prompts()]
    plain, _ = _run(tiny, schedule, None, waves, params)
    speculated, engine = _run(tiny, schedule, LOOKAHEAD, waves, params)
    assert_same_greedy(plain, speculated)
    stats = engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # drafts were verified, some kept
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_seeded_sampling_gives_a_well_formed_run(tiny):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    runs = [_run(tiny, "whole", LOOKAHEAD, [_prompts()], params) for _ in range(2)]
    (first, engine), (second, _) = runs
    for r in first:
        assert len(r.output_token_ids) == 20 and all(0 <= t < VOCAB for t in r.output_token_ids)
    # Drafts are deterministic (the prompt seeds the window's first guesses): the same run samples the same.
    assert [r.output_token_ids for r in second] == [r.output_token_ids for r in first]
    assert engine.scheduler.spec_stats.num_draft_tokens > 0
