"""SuffixDecoding keeps greedy outputs exactly the model's: tiny models give the same tokens and
logprobs with the suffix proposer as without speculation, whether its drafts come from the request's
own context or (for requests that run after others) from earlier requests' outputs."""

from __future__ import annotations

import pytest
import torch

from folio import SamplingParams
from folio.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from folio.engine.engine_core import EngineCore
from folio.engine.model_loader import load_model
from folio.engine.request import Request
from tests.tiny_models import VOCAB, make_tiny_model

SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_max_spec_factor=2.0)
SCHEDULES = {"whole": (1024, 256), "chunked": (7, 256), "preempting": (16, 20)}  # (token budget, blocks of 4)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(folder, torch.float32, torch.device("cpu"))


def _engine(loaded, schedule: str, speculative: SpeculativeConfig | None) -> EngineCore:
    budget, num_blocks = SCHEDULES[schedule]
    return EngineCore(loaded.model, loaded.config, CacheConfig(block_size=4, num_blocks=num_blocks),
                      SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=512),
                      torch.float32, torch.device("cpu"), speculative)  # fmt: skip


def _greedy(engine: EngineCore, waves: list[list[list[int]]], tag: str = "") -> list[Request]:
    """Each wave's prompts run together, the next wave once they have finished."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    done: list[Request] = []
    for wave in waves:
        requests = [Request(f"{tag}{len(done) + i}", p, params) for i, p in enumerate(wave)]
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        done += requests
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    return done


def _prompts(seed: int, lengths: tuple[int, ...], repeats: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, VOCAB, (n,), generator=generator).tolist() * repeats)[: repeats * n] for n in lengths]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tiny_models_greedy_tokens_and_logprobs_equal_without_speculation(tiny, schedule):
    # A first wave whose prompts repeat themselves (the request's own tree drafts), then a second that
    # asks two of them again and a new one, after the first wave's outputs went to the global tree.
    first = _prompts(3, (10, 2, 6), repeats=4)
    waves = [first, [first[0], _prompts(4, (9,), repeats=1)[0], first[2]]]
    plain = _greedy(_engine(tiny, schedule, None), waves)
    engine = _engine(tiny, schedule, SUFFIX)
    speculated = _greedy(engine, waves)
    for a, b in zip(plain, speculated, strict=True):
        assert b.output_token_ids == a.output_token_ids
        assert [lp.token_id for lp in b.output_logprobs] == b.output_token_ids
        got, expected = ([lp.logprob for lp in r.output_logprobs] for r in (b, a))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)
    assert engine.scheduler.spec_stats.num_draft_tokens > 0  # drafts were verified
    # The runner hears of a finished request at the next step: by then the first wave had finished.
    assert len(engine.runner.proposer.cached) >= len(first)
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_earlier_outputs_draft_for_a_later_request(tiny):
    """A prompt that does not repeat itself, asked twice in a row: the second time, the first answer
    in the global tree supplies drafts from its first token, which the target then accepts."""
    prompt = _prompts(5, (12,), repeats=1)[0]
    accepted = {}
    for cached in (0, 10):
        engine = _engine(tiny, "whole", SpeculativeConfig(method="suffix", suffix_max_cached_requests=cached))
        (first,) = _greedy(engine, [[prompt]], tag="first")
        before = engine.scheduler.spec_stats.num_accepted_tokens
        (second,) = _greedy(engine, [[prompt]], tag="second")
        assert second.output_token_ids == first.output_token_ids
        accepted[cached] = engine.scheduler.spec_stats.num_accepted_tokens - before
    assert accepted[10] > accepted[0] and accepted[10] >= 12
