"""KV cache groups (kv_cache/groups.py) and a manager with a block table per group: window groups give
blocks back, global groups keep them, every table of a request has the same length, nothing leaks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.kv_cache.groups import one_group, plan_kv_groups
from folio.kv_cache.hashing import extend_block_keys
from folio.kv_cache.manager import KVCacheManager
from folio.layers.attention.metadata import build_attention_metadata, build_grouped_metadata

BLOCK = 4
GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # every sixth layer global


def test_gemma3_270m_splits_into_one_global_group_and_five_window_groups_of_three_layers():
    groups = plan_kv_groups(GEMMA3_270M)
    assert groups.layers_per_block == 3 and groups.windows == (None, 512, 512, 512, 512, 512)
    assert [groups.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert [groups.layer_slot[i] for i in (5, 11, 17)] == [0, 1, 2]
    # The window layers fill their groups in order, three to a block.
    assert groups.layer_group[:5] == (1, 1, 1, 2, 2) and groups.layer_slot[:5] == (0, 1, 2, 0, 1)
    # Each (group, slot) belongs to exactly one layer.
    assert len({(g, s) for g, s in zip(groups.layer_group, groups.layer_slot, strict=True)}) == 18


def test_a_kind_that_does_not_divide_evenly_leaves_its_last_group_short():
    # Gemma 3 1B: 26 layers, 4 global. Groups of 4: 22 window layers make 6 groups, the last of 2.
    groups = plan_kv_groups([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert groups.layers_per_block == 4 and groups.num_groups == 7
    assert sorted(groups.layer_group).count(6) == 2


def test_one_kind_of_layer_is_one_group_holding_every_layer():
    assert plan_kv_groups([None] * 5) == one_group(5)
    assert plan_kv_groups([8] * 3) == one_group(3, 8)
    assert not one_group(5).is_hybrid and one_group(3, 8).drops_blocks and not one_group(5).drops_blocks


def _held(kv: KVCacheManager) -> int:
    return kv.pool.num_blocks - kv.pool.num_free_blocks


def test_the_window_table_gives_blocks_back_and_the_global_table_keeps_them():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, group_windows=(None, 8))
    assert kv.allocate_slots("a", 40)  # 10 blocks in each table
    assert _held(kv) == 20 and kv.capacity_tokens == 128
    global_before, window_before = (list(t) for t in kv.tables_of("a"))
    assert kv.drop_out_of_window("a", 40) == 7  # blocks 0..7 of the window table; the first is the placeholder
    global_after, window_after = kv.tables_of("a")
    assert global_after == global_before
    assert window_after[:8] == [window_before[0]] * 8 and window_after[8:] == window_before[8:]
    assert _held(kv) == 13
    kv.free("a")
    assert kv.pool.num_free_blocks == 64 and not any(kv.pool.ref_counts)


def test_a_hybrid_pool_holds_long_requests_once_its_window_tables_fit():
    # window 8 + a 16-token step: ceil(23 / 4) + 1 = 7 blocks for the window table, and the placeholder.
    kv = KVCacheManager(num_blocks=28, block_size=BLOCK, group_windows=(None, 8))
    assert kv.capacity_tokens == 56  # every block kept: 14 per table
    assert kv.longest_request_tokens(16) == 80  # the global table takes the other 20 blocks
    assert KVCacheManager(10, BLOCK, group_windows=(None, 8)).longest_request_tokens(16) == 20


def test_each_group_caches_its_own_blocks_and_a_hit_takes_the_window_groups_last_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, enable_prefix_caching=True, group_windows=(None, 4))

    class Prompt:  # what the manager reads from a request
        request_id, prefix_salt, num_computed_tokens, num_tokens = "a", None, 20, 21
        block_keys: list = []

        def all_token_ids(self) -> list[int]:
            return list(range(21))

    assert kv.allocate_slots("a", 21)
    kv.cache_full_blocks(Prompt())
    tables = [list(t) for t in kv.tables_of("a")]
    keys: list = []
    extend_block_keys(keys, list(range(21)), BLOCK, None)
    assert [kv.pool.lookup(k, 0) for k in keys[:5]] == tables[0][:5]
    assert [kv.pool.lookup(k, 1) for k in keys[:5]] == tables[1][:5]
    kv.drop_out_of_window("a", 20)
    kv.free("a")

    class Again(Prompt):
        request_id = "b"
        block_keys: list = []

    hit = kv.find_cached_prefix(Again())
    # The query at 20 sees keys 17..20: the window group needs its block 4 only, the rest is the placeholder.
    assert hit == [tables[0][:5], [-1, -1, -1, -1, tables[1][4]]]
    assert kv.allocate_slots("b", 21, hit) and kv.tables_of("b")[0][:5] == tables[0][:5]
    kv.free("b")
    assert kv.allocate_slots("c", 4 * 32 // 2)  # every block handed out anew: the cache is evicted
    kv.free("c")
    assert kv.find_cached_prefix(Again()) == [[], []]


def test_a_fork_copies_the_shared_partial_block_in_every_group():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, group_windows=(None, 8))
    assert kv.allocate_slots("a", 6)
    kv.fork("a", "b")
    assert kv.allocate_slots("b", 7, write_from=6)  # position 6 is in the shared block 1
    copies = kv.take_copies()
    assert [src for src, _ in copies] == [kv.block_table("a", 0)[1], kv.block_table("a", 1)[1]]
    assert [dst for _, dst in copies] == [kv.block_table("b", 0)[1], kv.block_table("b", 1)[1]]
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_free_blocks == 16


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from("abc"), st.integers(1, 12)), max_size=40))
def test_random_operations_keep_tables_aligned_bounded_and_leak_nothing(ops):
    windows = (None, 6, None, 6)
    kv = KVCacheManager(num_blocks=48, block_size=BLOCK, group_windows=windows)
    lengths: dict[str, int] = {}
    for action, request_id, grow in ops:
        if action == 0:
            kv.free(request_id)
            lengths.pop(request_id, None)
        elif action in (1, 2):
            total = lengths.get(request_id, 0) + grow
            if kv.allocate_slots(request_id, total, write_from=lengths.get(request_id)):
                lengths[request_id] = total
                kv.take_copies()
                kv.drop_out_of_window(request_id, total)
        elif request_id in lengths and f"{request_id}2" not in kv.block_tables:
            kv.fork(request_id, f"{request_id}2")
            lengths[f"{request_id}2"] = lengths[request_id]
        for rid, tables in kv.block_tables.items():
            assert len({len(t) for t in tables}) == 1  # every group's table as long as the others
            for window, table in zip(windows, tables, strict=True):
                real = [b for b in table if b != kv._placeholder]
                if window is not None:  # the window's blocks and the one being written, at most
                    assert len(real) <= kv.blocks_needed(window - 1 + 12) + 1
                else:
                    assert len(real) == len(table) == kv.blocks_needed(lengths[rid])
        holders: dict[int, int] = {}
        for tables in kv.block_tables.values():
            for block in (b for t in tables for b in t):
                holders[block] = holders.get(block, 0) + 1
        if kv._placeholder is not None:
            holders[kv._placeholder] = holders.get(kv._placeholder, 0) + 1  # the manager's own hold
        assert all(kv.pool.ref_counts[b] == n for b, n in holders.items())
        assert len(holders) + kv.pool.num_free_blocks == kv.pool.num_blocks
    for request_id in list(kv.block_tables):
        kv.free(request_id)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


class _Request:
    """What the manager reads from a request: 21 tokens, all but the last computed."""

    prefix_salt, num_computed_tokens, num_tokens = None, 20, 21

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.block_keys: list = []

    def all_token_ids(self) -> list[int]:
        return list(range(21))


def test_a_window_group_hit_needs_only_the_blocks_its_window_reaches():
    kv = KVCacheManager(num_blocks=14, block_size=BLOCK, enable_prefix_caching=True, group_windows=(None, 6))
    assert kv.allocate_slots("a", 21)
    kv.cache_full_blocks(_Request("a"))
    global_table, window_table = (list(t) for t in kv.tables_of("a"))
    kv.drop_out_of_window("a", 20)  # query 20 sees 15..20: window blocks 0..2 go back (block 0 stays, placeholder)
    kv.free("a")
    hit = kv.find_cached_prefix(_Request("b"))
    # Five full blocks: the next query (position 20) sees keys 15..20, blocks 3 and 4 of the window group.
    assert hit[0] == global_table[:5]
    assert hit[1][:3] == [-1, -1, -1] and hit[1][3:] == window_table[3:5]
    assert kv.allocate_slots("b", 21, hit)
    placeholder = kv._placeholder
    assert placeholder is not None and kv.tables_of("b")[1][:3] == [placeholder] * 3
    assert kv._num_dropped["b"] == [0, 3]
    kv.free("b")
    assert kv.pool.num_free_blocks == 14 and not any(kv.pool.ref_counts) and kv._placeholder is None


def test_a_window_group_hit_stops_where_its_window_blocks_were_evicted():
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK, enable_prefix_caching=True, group_windows=(None, 6))
    assert kv.allocate_slots("a", 21)
    kv.cache_full_blocks(_Request("a"))
    window_table = list(kv.tables_of("a")[1])
    kv.free("a")  # nothing dropped: freed tail first, so the window table's last blocks are evicted first
    for block in window_table[3:6]:
        kv.pool._forget(block)  # evicted
    hit = kv.find_cached_prefix(_Request("b"))
    # A 3-block prefix: the query at 12 sees 7..12, window blocks 1 and 2, both still cached.
    assert len(hit[0]) == len(hit[1]) == 3 and hit[1] == [-1, *window_table[1:3]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.booleans()), min_size=1, max_size=6))
def test_each_groups_view_of_a_step_is_that_groups_own_metadata(sequences):
    """build_grouped_metadata derives the other groups' views from the first's: they must equal the
    metadata built from each group's tables alone (decodes, verifications and prefill chunks mixed)."""
    starts = [start for start, _, _ in sequences]
    lens = [qlen for _, qlen, _ in sequences]
    as_decodes = [verify for _, _, verify in sequences]
    tables = [
        [[(7 * g + 3 * i + b) % 97 for b in range(-(-(start + qlen) // BLOCK))] for g in range(3)]
        for i, (start, qlen, _) in enumerate(sequences)
    ]
    grouped = build_grouped_metadata(starts, lens, tables, BLOCK, as_decodes=as_decodes)
    assert len(grouped.by_kv_group) == 3 and grouped.for_kv_group(0) is grouped
    for g in range(3):
        alone = build_attention_metadata(starts, lens, [t[g] for t in tables], BLOCK, as_decodes=as_decodes)
        view = grouped.for_kv_group(g)
        assert torch.equal(view.slot_mapping, alone.slot_mapping) and view.num_tokens == alone.num_tokens
        assert len(view.groups) == len(alone.groups)
        for mine, theirs in zip(view.groups, alone.groups, strict=True):
            for name in ("token_rows", "block_tables", "query_positions", "seq_lens"):
                assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
            assert mine.as_decode_rows()[0].equal(theirs.as_decode_rows()[0])
            assert (mine.fresh_prompt, mine.num_key_slots) == (theirs.fresh_prompt, theirs.num_key_slots)
