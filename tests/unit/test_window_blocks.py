"""Blocks that fell out of every layer's sliding window go back to the pool (kv_cache/manager.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kv_cache.hashing import extend_block_keys
from folio.kv_cache.manager import KVCacheManager

BLOCK = 4


def _held(kv: KVCacheManager) -> int:
    return kv.pool.num_blocks - kv.pool.num_free_blocks


def test_blocks_behind_the_window_are_given_back_and_one_placeholder_fills_their_places():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, group_windows=(8,))
    assert kv.allocate_slots("a", 40)  # 10 blocks
    table = list(kv.block_table("a"))
    # The next query sits at 40 and sees keys 33..40: blocks 0..7 (positions 0..31) are behind it.
    assert kv.drop_out_of_window("a", 40) == 7  # the first dropped block becomes the placeholder
    after = kv.block_table("a")
    assert after[:8] == [table[0]] * 8 and after[8:] == table[8:]
    assert _held(kv) == 3 and kv.pool.ref_counts[table[0]] == 9  # eight places and the manager's own hold
    assert kv.drop_out_of_window("a", 40) == 0  # nothing new to drop
    assert kv.drop_out_of_window("a", 41) == 0  # key 33 is still seen
    assert kv.allocate_slots("a", 44)
    assert kv.drop_out_of_window("a", 44) == 1  # query 44 sees 37..44: block 8 (32..35) went out
    kv.free("a")
    assert kv.pool.num_free_blocks == 32 and not any(kv.pool.ref_counts)  # the placeholder went back too


def test_a_window_shorter_than_a_block_keeps_the_block_being_written():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, group_windows=(1,))
    assert kv.allocate_slots("a", 6)  # the next token goes to position 6, in block 1
    assert kv.drop_out_of_window("a", 6) == 0 and kv.block_table("a")[1] != kv.block_table("a")[0]
    assert kv._num_dropped["a"] == [1]


def test_without_a_window_nothing_is_dropped_and_requests_are_bounded_by_the_pool():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    assert kv.allocate_slots("a", 32)
    assert kv.drop_out_of_window("a", 32) == 0 and _held(kv) == 8
    assert kv.longest_request_tokens(16) == 32


def test_a_windowed_pool_takes_requests_of_any_length_once_it_holds_a_windows_step():
    # window 8 + a 16-token step: ceil(23 / 4) = 6 blocks, a partial one and the placeholder
    assert KVCacheManager(8, BLOCK, group_windows=(8,)).longest_request_tokens(16) is None
    assert KVCacheManager(7, BLOCK, group_windows=(8,)).longest_request_tokens(16) == 28


def test_forks_share_the_placeholder_and_dropped_blocks_keep_their_prefix_cache_keys():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True, group_windows=(4,))

    class Prompt:  # what cache_full_blocks reads from a request
        request_id, prefix_salt, num_computed_tokens = "a", None, 20
        block_keys: list = []

        def all_token_ids(self) -> list[int]:
            return list(range(21))

    assert kv.allocate_slots("a", 21)
    kv.cache_full_blocks(Prompt())  # five full blocks registered
    table = list(kv.block_table("a"))
    assert kv.drop_out_of_window("a", 20) == 3  # query 20 sees 17..20: blocks 0..3 out
    kv.fork("a", "b")
    assert kv.block_table("b") == kv.block_table("a") and kv._num_dropped["b"] == [4]
    kv.free("a")
    assert kv.pool.ref_counts[table[0]] == 5  # b's four places and the manager
    kv.free("b")
    assert kv.pool.num_free_blocks == 16
    keys: list = []
    extend_block_keys(keys, list(range(21)), BLOCK, None)
    assert [kv.pool.lookup(key) for key in keys[:5]] == table[:5]  # still revivable from the free list


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 12), st.integers(0, 3)), max_size=40))
def test_random_growth_drops_and_frees_never_leak(ops):
    kv = KVCacheManager(num_blocks=24, block_size=BLOCK, group_windows=(6,))
    lengths: dict[str, int] = {}
    for request_id, grow, action in ops:
        if action == 0:
            kv.free(request_id)
            lengths.pop(request_id, None)
            continue
        length = lengths.get(request_id, 0) + grow
        if kv.allocate_slots(request_id, length):
            lengths[request_id] = length
            kv.drop_out_of_window(request_id, length)
            table = kv.block_table(request_id)
            seen_from = max(length - 6 + 1, 0) // BLOCK  # the first block any later query sees
            assert len(set(table[seen_from:])) == len(table) - seen_from  # the seen blocks are the request's own
        if action == 3 and request_id in lengths and f"{request_id}2" not in kv.block_tables:
            kv.fork(request_id, f"{request_id}2")
            lengths[f"{request_id}2"] = lengths[request_id]
    for request_id in list(kv.block_tables):
        kv.free(request_id)
    assert kv.pool.num_free_blocks == 24 and not any(kv.pool.ref_counts)
