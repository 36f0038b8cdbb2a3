"""`--kv-offload-ram`: prefix-cache blocks the pool evicts go to a host-RAM tier and come back from it for a
later prompt with that prefix. Outputs (greedy tokens and logprobs) equal those with prefix caching off,
for every KV format, with the prompt chunked and under preemption; and the tier is what served them."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from folio import LLM, SamplingParams
from folio.server.metrics import ServerMetrics
from tests.tiny_models import VOCAB, make_tiny_model

BLOCK = 4
STEPS = 8


def _tokens(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# Three sessions with long prefixes of their own (6 blocks), then each again with a new turn: a pool of
# 16 blocks holds about one and a half, so by the second round every prefix has been evicted.
SESSIONS = [_tokens(10 + i, 24) for i in range(3)]
FIRST = [s + _tokens(20 + i, 3) for i, s in enumerate(SESSIONS)]
SECOND = [s + _tokens(30 + i, 5) for i, s in enumerate(SESSIONS)]
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tier"))


def _outputs(llm: LLM, together: bool = False) -> list:
    """The first round one prompt at a time, as a chat's turns come; the second the same, or all at once
    (three requests of 10 blocks in a pool of 16: preemption)."""
    one_by_one = [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in FIRST]
    if together:
        return one_by_one + llm.generate(SECOND, GREEDY, use_tqdm=False)
    return one_by_one + [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in SECOND]


def _same(ours: list, theirs: list, tolerance: float) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=tolerance)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("schedule", ["whole", "chunked", "preempting"])
def test_outputs_with_the_tier_equal_outputs_without_it(tiny_llama, kv_cache_dtype, schedule):
    settings = {"block_size": BLOCK, "kv_cache_dtype": kv_cache_dtype}
    if schedule == "chunked":
        settings["max_num_batched_tokens"] = 7
    together = schedule == "preempting"
    tiered = LLM(tiny_llama, num_kv_blocks=16, kv_offload_ram="1MiB", **settings)
    with_tier = _outputs(tiered, together)
    # A pool that never evicts: every prefix hit comes from it. The tier's blocks come back bit for bit,
    # so a request that loads them computes exactly what one that finds them in the pool does.
    roomy = _outputs(LLM(tiny_llama, num_kv_blocks=64, **settings), together)
    if not together:
        _same(with_tier, roomy, 1e-6)
    if kv_cache_dtype == "auto":  # the KV as computed: caching changes no output
        _same(with_tier, _outputs(LLM(tiny_llama, num_kv_blocks=16, enable_prefix_caching=False, **settings)), 1e-4)
    elif together:
        # 8-bit KV: a chunk attends to its own keys as computed and to earlier ones as stored, so where a
        # preempted request's blocks are recomputed differs by the codes' rounding, never by a token.
        _same(with_tier, roomy, 0.1)
    tier = tiered.engine.kv.tier
    assert tier is not None and tier.num_loaded > 0 and tier.num_stored > 0
    reading = tiered.engine.make_stats().tier  # what /metrics reports
    assert reading is not None and (reading.loaded_blocks, reading.stored_blocks) == (tier.num_loaded, tier.num_stored)
    assert 0 < reading.used_blocks <= reading.capacity_blocks
    if not together:  # each session's 6 prefix blocks came back, from the pool or the tier
        assert [o.metrics.num_cached_tokens for o in with_tier[3:]] == [24, 24, 24]
    else:
        assert tiered.engine.make_stats().num_preemptions > 0
    pool = tiered.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_without_a_tier_the_second_round_recomputes(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK)
    assert [o.metrics.num_cached_tokens for o in _outputs(llm)[3:]] == [0, 0, 0]


def test_a_tier_needs_prefix_caching_and_room_for_a_block(tiny_llama):
    with pytest.raises(ValueError, match="needs prefix caching on"):
        LLM(tiny_llama, num_kv_blocks=16, enable_prefix_caching=False, kv_offload_ram="1MiB")
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(tiny_llama, num_kv_blocks=16, kv_offload_ram=64)


def test_metrics_count_the_tiers_blocks(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, kv_offload_ram="1MiB")
    _outputs(llm)
    metrics = ServerMetrics(llm.engine, "tiny")
    metrics.on_step([], 0.0)
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in f.samples}  # fmt: skip
    tier = llm.engine.kv.tier
    assert tier is not None and samples["folio:kv_offload_ram_loaded_blocks_total"] == tier.num_loaded > 0
    assert samples["folio:kv_offload_ram_stored_blocks_total"] == tier.num_stored
    assert samples["folio:kv_offload_ram_usage_ratio"] == tier.num_used / tier.num_slots
