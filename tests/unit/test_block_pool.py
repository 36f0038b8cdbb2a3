from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from folio.kv_cache.block_pool import BlockPool, BlockPoolError
from folio.kv_cache.manager import KVCacheManager


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free_blocks == 3
    pool.free(blocks)
    assert pool.num_free_blocks == 8 and all(c == 0 for c in pool.ref_counts)


def test_double_free_and_overdraw_are_errors():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.allocate(3)


def test_shared_block_is_freed_only_by_its_last_owner():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.share(block)
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_manager_refuses_without_side_effects_when_short():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 12)  # 3 blocks
    assert not kv.allocate_slots("b", 8)  # needs 2, 1 free
    assert "b" not in kv.block_tables and kv.pool.num_free_blocks == 1
    assert kv.allocate_slots("a", 16)  # grows by one
    assert len(kv.block_table("a")) == 4
    kv.free("a")
    assert kv.pool.num_free_blocks == 4


@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 40), st.booleans()), max_size=60))
def test_random_operations_never_leak_or_double_count(ops):
    kv = KVCacheManager(num_blocks=16, block_size=4)
    for request_id, tokens, free in ops:
        if free:
            kv.free(request_id)
        else:
            before = list(kv.block_tables[request_id][0]) if request_id in kv.block_tables else []
            if kv.allocate_slots(request_id, tokens):
                assert len(kv.block_table(request_id)) >= kv.blocks_needed(tokens)
                assert kv.block_table(request_id)[: len(before)] == before
        owned = [b for tables in kv.block_tables.values() for table in tables for b in table]
        assert len(owned) == len(set(owned))  # no block in two tables
        assert len(owned) + kv.pool.num_free_blocks == kv.pool.num_blocks
        assert sum(kv.pool.ref_counts) == len(owned)
