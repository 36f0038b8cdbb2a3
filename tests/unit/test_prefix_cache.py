"""Prefix-cache bookkeeping without a model: keys, the LRU free list, and the scheduler with shared
prefixes under tiny pools (every request finishes as in an unconstrained run, no block leaks)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.config import SchedulerConfig
from folio.engine.request import Request
from folio.engine.scheduler import Scheduler
from folio.kv_cache.block_pool import BlockPool
from folio.kv_cache.hashing import ROOT, BlockKey, extend_block_keys
from folio.kv_cache.manager import KVCacheManager
from folio.sampling_params import SamplingParams
from folio.step import ModelRunnerOutput
from tests.step_values import SentTables
from tests.unit.test_scheduler import EOS, fake_next_token


def test_keys_chain_and_salt_only_changes_the_chain():
    keys: list[BlockKey] = []
    extend_block_keys(keys, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None)
    assert [k.token_ids for k in keys] == [(1, 2, 3, 4), (5, 6, 7, 8)]  # the partial block has no key
    assert keys[0].parent == ROOT and keys[1].parent == keys[0].digest
    salted: list[BlockKey] = []
    extend_block_keys(salted, [1, 2, 3, 4, 5, 6, 7, 8], 4, "tenant")
    assert salted[0] != keys[0] and salted[1] != keys[1] and salted[1].extra is None  # carried by the chain
    other: list[BlockKey] = []
    extend_block_keys(other, [9, 2, 3, 4, 5, 6, 7, 8], 4, None)
    assert other[1].token_ids == keys[1].token_ids and other[1] != keys[1]  # same tokens, other prefix


def test_freed_blocks_stay_cached_until_evicted_least_recent_first():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    key_a, key_b = BlockKey(ROOT, (1,)), BlockKey(ROOT, (2,))
    pool.register(a, key_a)
    pool.register(b, key_b)
    pool.free([a, b])  # freed tail first: b is evicted before a
    assert pool.num_free_blocks == 4 and pool.lookup(key_a) == a and pool.lookup(key_b) == b
    pool.touch(a)  # revived from the free list
    assert pool.ref_counts[a] == 1 and pool.num_free_blocks == 3
    taken = pool.allocate(3)  # the two never-used blocks, then b (evicted)
    assert b in taken and pool.lookup(key_b) is None and pool.lookup(key_a) == a


def test_a_second_block_with_the_same_key_stays_anonymous():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    key = BlockKey(ROOT, (7, 7))
    pool.register(first, key)
    pool.register(second, key)
    assert pool.lookup(key) == first and pool.keys[second] is None
    pool.free([second])
    pool.allocate(1)  # evicting the anonymous block must not drop the cached one
    assert pool.lookup(key) == first


def test_admission_takes_the_cached_prefix_only_if_the_rest_fits():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4, max_model_len=100), kv)
    first = Request("a", list(range(1, 14)), SamplingParams(max_tokens=1))
    scheduler.add_request(first)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(sampled_token_ids={"a": [5]}))
    assert first.is_finished and kv.pool.num_cached_blocks == 3
    second = Request("b", list(range(1, 14)) + [9, 9, 9], SamplingParams(max_tokens=1))
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert second.num_cached_tokens == 12 and out.scheduled[0].start_position == 12
    assert out.scheduled[0].token_ids == [13, 9, 9, 9]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (13 + 16, 12)


def _run_with_cache(prompts, max_tokens, num_blocks, block_size, budget, max_seqs):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(budget, max_seqs, 10_000), kv)
    requests = [Request(str(i), p, SamplingParams(max_tokens=m, temperature=0), eos_token_ids=frozenset({EOS}))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]  # fmt: skip
    pending = list(requests)
    steps = 0
    sent = SentTables()
    while pending or scheduler.has_unfinished:
        if pending:  # requests arrive over time, so later ones can hit what earlier ones cached
            scheduler.add_request(pending.pop(0))
        steps += 1
        assert steps < 10_000
        out = scheduler.schedule()
        sent.apply(out)
        holders: dict[int, int] = {}
        for tables in kv.block_tables.values():
            for block in (b for table in tables for b in table):
                holders[block] = holders.get(block, 0) + 1
        assert all(kv.pool.ref_counts[b] == n for b, n in holders.items())  # shared blocks counted once each
        assert len(holders) + kv.pool.num_free_blocks == num_blocks
        sampled = {}
        for item in out.scheduled:
            request = scheduler.requests[item.request_id]
            end = item.start_position + item.num_tokens
            assert len(sent[item.request_id]) * block_size >= end
            assert sent.tables_of(item.request_id) == kv.tables_of(item.request_id)  # the deltas rebuild the table
            if item.needs_sample:
                sampled[item.request_id] = [fake_next_token(request.token_ids_between(0, end))]
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    assert kv.pool.num_free_blocks == num_blocks and not kv.block_tables
    return [r.output_token_ids for r in requests], kv


@settings(max_examples=40, deadline=None)
@given(
    prefix=st.lists(st.integers(1, 50), min_size=0, max_size=20),
    tails=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=12), min_size=1, max_size=6),
    max_tokens=st.integers(1, 12),
    num_blocks=st.integers(12, 30),  # the longest request (44 tokens) must fit the pool alone
    budget=st.integers(1, 24),
)
def test_shared_prefixes_under_tiny_pools_match_an_unconstrained_run(prefix, tails, max_tokens, num_blocks, budget):
    prompts = [prefix + tail for tail in tails]
    lengths = [max_tokens] * len(prompts)
    expected, _ = _run_with_cache(prompts, lengths, 1000, 4, 10_000, 64)
    got, kv = _run_with_cache(prompts, lengths, num_blocks, 4, budget, 4)
    assert got == expected
    assert kv.prefix_cache_hits <= kv.prefix_cache_queries
