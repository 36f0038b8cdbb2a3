"""n samples per prompt share the prompt's KV blocks (forks, copy-on-write of the last partial block).
Each sample must equal the same sample drawn alone, without any sharing."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.engine.request import Request
from tests.tiny_models import VOCAB, make_tiny_model

pytest.importorskip("transformers")

BLOCK = 4


def _tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _llm(folder, **kwargs) -> LLM:
    settings = dict(num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=1024, enable_prefix_caching=False)
    return LLM(folder, **{**settings, **kwargs})


def _alone(llm: LLM, prompt: list[int], params: SamplingParams, n: int) -> list[list[int]]:
    """Sample j drawn as its own request with seed + j: no forks, no sharing."""
    return [
        llm.generate([prompt], SamplingParams(**{**params.__dict__, "n": 1, "seed": params.seed + j}),
                     use_tqdm=False)[0].outputs[0].token_ids
        for j in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("prompt_len", [22, 24], ids=["partial-last-block", "full-blocks"])
@pytest.mark.parametrize("schedule", [{}, {"max_num_batched_tokens": 5}, {"num_kv_blocks": 24}],
                         ids=["whole", "chunked", "preempting"])  # fmt: skip
def test_forked_samples_equal_samples_drawn_alone(folder, prompt_len, schedule):
    prompt = _tokens(prompt_len, prompt_len)
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    llm = _llm(folder, **schedule)
    forked = llm.generate([prompt, _tokens(5, 9)], [params, SamplingParams(max_tokens=6, temperature=0)],
                          use_tqdm=False)  # fmt: skip
    samples = [o.token_ids for o in forked[0].outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    assert samples == _alone(_llm(folder), prompt, params, 4)
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_greedy_samples_are_identical(folder):
    llm = _llm(folder)
    prompt = _tokens(1, 13)
    outputs = llm.generate([prompt], SamplingParams(n=3, max_tokens=8, temperature=0), use_tqdm=False)[0].outputs
    single = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    assert [o.token_ids for o in outputs] == [single.token_ids] * 3


def test_the_pool_holds_the_prompt_once(folder):
    llm = _llm(folder)
    engine = llm.engine
    prompt = _tokens(2, 22)  # 5 full blocks and 2 tokens in a sixth
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    first = Request("p", prompt, params)
    forks = [Request(f"f{j}", prompt, params) for j in range(3)]
    engine.add_request(first, forks)
    engine.step()  # the prompt is computed once, and all four sample their first token from it
    tables = [engine.kv.block_table(r.request_id) for r in (first, *forks)]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 6
    assert all(engine.kv.pool.ref_counts[b] == 4 for b in tables[0])
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 6  # the prompt, once
    engine.step()  # each writes its first token into the shared partial block: copied on write
    tables = [engine.kv.block_table(r.request_id) for r in (first, *forks)]
    assert all(t[:5] == tables[0][:5] for t in tables)  # full prompt blocks still shared
    assert len({t[5] for t in tables}) == 4  # the partial block now one per sample
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 5 - 4
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_aborting_the_first_sample_before_it_samples_keeps_the_others(folder):
    llm = _llm(folder, max_num_batched_tokens=4)
    engine = llm.engine
    prompt = _tokens(3, 18)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    first, forks = Request("p", prompt, params), [Request(f"f{j}", prompt, params) for j in range(2)]
    engine.add_request(first, forks)
    engine.step()  # a first chunk of the prompt only
    engine.abort_request("p")
    engine.abort_request("f1")
    while engine.has_unfinished():
        engine.step()
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert forks[0].output_token_ids == alone and forks[1].finish_reason.value == "abort"
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
