"""Prefix caching through the whole engine: outputs with the cache equal outputs without it, and both
equal transformers, across chunked prefill, preemption, seeds, salts and forced hash collisions."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from folio.kv_cache import hashing
from tests.reference import reference_greedy
from tests.tiny_models import VOCAB, make_tiny_model

transformers = pytest.importorskip("transformers")

BLOCK = 4
STEPS = 12


def _tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


SHARED = _tokens(100, 22)  # 5 full blocks and a partial one
PROMPTS = [SHARED + _tokens(i, 3 + 2 * i) for i in range(4)] + [SHARED[:8] + _tokens(9, 9), SHARED]


# Block tables per request: the tiny Gemma 3 has one per KV cache group (window layers, global layers),
# each block holding 2 of its 4 layers, so the same memory holds twice the blocks.
TABLES = {"llama": 1, "gemma3": 2}


@pytest.fixture(scope="module", params=sorted(TABLES))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def model_folder(kind, tmp_path_factory):
    return make_tiny_model(kind, tmp_path_factory.mktemp(kind))


def _llm(folder, caching: bool, **kwargs) -> LLM:
    settings = dict(num_kv_blocks=256, block_size=BLOCK, max_num_batched_tokens=1024)
    return LLM(folder, enable_prefix_caching=caching, **{**settings, **kwargs})


def _run(llm: LLM, prompts, params) -> list:
    """One prompt first (it fills the cache), then the rest together."""
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    return first + llm.generate(prompts[1:], params, use_tqdm=False)


GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("schedule", [{}, {"max_num_batched_tokens": 7}, {"num_kv_blocks": 14}],
                         ids=["whole", "chunked", "preempting"])  # fmt: skip
def test_cached_outputs_equal_uncached_and_transformers(kind, model_folder, schedule):
    if "num_kv_blocks" in schedule:
        schedule = {"num_kv_blocks": schedule["num_kv_blocks"] * TABLES[kind]}
    cached_llm, plain_llm = _llm(model_folder, True, **schedule), _llm(model_folder, False, **schedule)
    cached, plain = _run(cached_llm, PROMPTS, GREEDY), _run(plain_llm, PROMPTS, GREEDY)
    assert sum(o.metrics.num_cached_tokens for o in cached) > 0  # the cache was actually used
    assert all(o.metrics.num_cached_tokens == 0 for o in plain)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    for prompt, with_cache, without in zip(PROMPTS, cached, plain, strict=True):
        assert with_cache.outputs[0].token_ids == without.outputs[0].token_ids
        for a, b in zip(with_cache.outputs[0].logprobs, without.outputs[0].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert with_cache.outputs[0].token_ids == reference_greedy(reference, prompt, STEPS)[0]
    pool = cached_llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # cached blocks stay revivable, but nobody holds them


def test_hits_cover_whole_blocks_and_always_leave_a_token_to_compute(model_folder):
    llm = _llm(model_folder, True)
    llm.generate([SHARED], GREEDY, use_tqdm=False)
    again = llm.generate([SHARED, SHARED[:20], SHARED + [1]], GREEDY, use_tqdm=False)
    # 22 tokens: 5 full blocks; the sixth is partial. An exact repeat of 20 tokens (5 blocks) must
    # still compute its last token, so it takes 4 blocks from the cache.
    assert [o.metrics.num_cached_tokens for o in again] == [20, 16, 20]
    assert llm.engine.kv.prefix_cache_hits == 56


def test_seeded_sampling_is_the_same_with_the_cache(model_folder):
    params = SamplingParams(max_tokens=STEPS, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    cached = _run(_llm(model_folder, True), PROMPTS, params)
    plain = _run(_llm(model_folder, False), PROMPTS, params)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]


def test_cache_salt_keeps_tenants_apart(model_folder):
    llm = _llm(model_folder, True)
    engine = llm.engine

    def run(salt: str | None) -> int:
        from folio.engine.request import Request

        request = Request(f"r{run.count}", list(SHARED), GREEDY, cache_salt=salt)
        run.count += 1
        engine.add_request(request)
        while engine.has_unfinished():
            engine.step()
        return request.num_cached_tokens

    run.count = 0
    assert run("tenant-a") == 0
    assert run("tenant-b") == 0  # same tokens, other tenant: no hit
    assert run(None) == 0
    assert run("tenant-a") == 20 and run("tenant-b") == 20 and run(None) == 20


def test_forced_hash_collisions_never_serve_another_prompts_kv(model_folder, monkeypatch):
    """Every key hashes alike: the cache map must still tell prompts apart by their tokens."""
    monkeypatch.setattr(hashing.BlockKey, "__hash__", lambda self: 0)
    cached = _run(_llm(model_folder, True), PROMPTS, GREEDY)
    plain = _run(_llm(model_folder, False), PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_cached_tokens for o in cached) > 0
