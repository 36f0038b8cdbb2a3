"""Lookahead decoding keeps greedy outputs exactly the model's: tiny models give the same tokens and
logprobs with the lookahead proposer as without speculation, under whole, chunked and preempting
schedules, and the prompts asked again draft from the first answers in the shared pool; seeded
sampling with it gives a well-formed run."""

from __future__ import annotations

import pytest
import torch

from folio import SamplingParams
from folio.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from folio.engine.engine_core import EngineCore
from folio.engine.model_loader import load_model
from folio.engine.request import Request
from tests.tiny_models import VOCAB, make_tiny_model

LOOKAHEAD = SpeculativeConfig(method="lookahead", num_speculative_tokens=4, lookahead_ngram_size=3)
SCHEDULES = {"whole": (1024, 256), "chunked": (7, 256), "preempting": (16, 20)}  # (token budget, blocks of 4)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(folder, torch.float32, torch.device("cpu"))


def _run(loaded, schedule: str, speculative: SpeculativeConfig | None, waves: list[list[list[int]]],
         params: SamplingParams) -> tuple[list[Request], EngineCore]:  # fmt: skip
    """Each wave's prompts run together, the next wave once they have finished."""
    budget, num_blocks = SCHEDULES[schedule]
    engine = EngineCore(loaded.model, loaded.config, CacheConfig(block_size=4, num_blocks=num_blocks),
                        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=512),
                        torch.float32, torch.device("cpu"), speculative)  # fmt: skip
    done: list[Request] = []
    for wave in waves:
        requests = [Request(str(len(done) + i), p, params) for i, p in enumerate(wave)]
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        done += requests
    assert engine.kv.pool.num_free_blocks == num_blocks
    return done, engine


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    # Prompts that repeat themselves, as in the prompt lookup test: the pool then holds their n-grams.
    return [(torch.randint(1, VOCAB, (n,), generator=generator).tolist() * 4)[: 4 * n] for n in (10, 2, 6)]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tiny_models_greedy_tokens_and_logprobs_equal_without_speculation(tiny, schedule):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    # A random tiny model's text seldom repeats: the second wave, asking the first's prompts again,
    # drafts from the first wave's outputs (in the shared pool by then), which the target accepts.
    waves = [_prompts(), _prompts()]
    plain, _ = _run(tiny, schedule, None, waves, params)
    speculated, engine = _run(tiny, schedule, LOOKAHEAD, waves, params)
    for a, b in zip(plain, speculated, strict=True):
        assert b.output_token_ids == a.output_token_ids
        assert [lp.token_id for lp in b.output_logprobs] == b.output_token_ids
        got, expected = ([lp.logprob for lp in r.output_logprobs] for r in (b, a))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)
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
