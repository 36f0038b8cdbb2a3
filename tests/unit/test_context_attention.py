"""Attention over a context split by position across ranks equals attention over the whole cache:
each rank's partial result over the keys it holds, merged by log-sum-exp, against the paged PyTorch
path on one cache. Ranks are simulated in one process (no collectives are involved in the parts
tested here): decodes of several sequences, a prompt chunk over a cached prefix, grouped-query heads,
sliding windows, ALiBi, and queries for which a rank holds no key at all."""

from __future__ import annotations

import pytest
import torch

from folio.distributed.context_parallel import ContextParallel, build_context_split
from folio.layers.attention import context_attention
from folio.layers.attention.alibi import alibi_slopes
from folio.layers.attention.context_attention import (
    attention_with_lse,
    local_keys,
    merge_partials,
    partial_attention,
    plain_attention_with_lse,
)
from folio.layers.attention.kv_tensors import allocate_layer_kv
from folio.layers.attention.metadata import build_attention_metadata
from folio.layers.attention.torch_paged import attend_group

BLOCK = 16
HEADS, KV_HEADS, DIM = 4, 2, 8


def _sequences(seed: int) -> dict:
    """Four sequences: two decoding (41 and 17 tokens cached), one prompt chunk of 20 tokens after a
    cached prefix of 30, and a fresh 13-token prompt, with block tables drawn from a pool of 14 blocks."""
    generator = torch.Generator().manual_seed(seed)
    tables = [[3, 7, 1], [5, 2], [0, 9, 4, 11], [13]]
    starts, lengths = [41, 17, 30, 0], [1, 1, 20, 13]
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    keys = [torch.randn(end, KV_HEADS, DIM, generator=generator) for end in ends]
    values = [torch.randn(end, KV_HEADS, DIM, generator=generator) for end in ends]
    queries = torch.randn(sum(lengths), HEADS, DIM, generator=generator)
    return {"tables": tables, "starts": starts, "lengths": lengths, "keys": keys, "values": values, "q": queries}


def _step_rows(seqs: dict) -> tuple[list[int], list[list[int]], torch.Tensor, torch.Tensor]:
    """The step's flat rows: positions, block tables, and their new keys and values."""
    positions, tables, keys, values = [], [], [], []
    for start, n, table, k, v in zip(seqs["starts"], seqs["lengths"], seqs["tables"], seqs["keys"], seqs["values"],
                                     strict=True):  # fmt: skip
        positions.extend(range(start, start + n))
        tables.extend([table] * n)
        keys.append(k[start:])
        values.append(v[start:])
    return positions, tables, torch.cat(keys), torch.cat(values)


def _whole(seqs: dict, window: int | None, slopes: torch.Tensor | None) -> torch.Tensor:
    cache = allocate_layer_kv(14 * BLOCK, KV_HEADS, DIM, torch.float32, None, torch.device("cpu"))
    for table, k, v in zip(seqs["tables"], seqs["keys"], seqs["values"], strict=True):
        cache.write(k, v, torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(k.shape[0])]))
    meta = build_attention_metadata(seqs["starts"], seqs["lengths"], seqs["tables"], BLOCK)
    _, _, step_k, step_v = _step_rows(seqs)
    out = torch.empty(meta.num_tokens, HEADS * DIM)
    for group in meta.groups:
        out[group.token_rows] = attend_group(group, seqs["q"], step_k, step_v, cache, BLOCK, 0.3, window, slopes)
    return out


def _split(seqs: dict, ranks: int, window: int | None, slopes: torch.Tensor | None) -> torch.Tensor:
    meta = build_attention_metadata(seqs["starts"], seqs["lengths"], seqs["tables"], BLOCK)
    assert any(group.fresh_prompt for group in meta.groups)
    positions, row_tables, step_k, step_v = _step_rows(seqs)
    parts = []
    for rank in range(ranks):
        split = build_context_split(ContextParallel(rank, ranks), positions, row_tables, BLOCK)
        cache = allocate_layer_kv(14 * BLOCK // ranks, KV_HEADS, DIM, torch.float32, None, torch.device("cpu"))
        for table, k, v in zip(seqs["tables"], seqs["keys"], seqs["values"], strict=True):
            mine = list(range(rank, k.shape[0], ranks))  # every token of the sequence this rank holds
            slots = torch.tensor([table[p // BLOCK] * (BLOCK // ranks) + p % BLOCK // ranks for p in mine])
            cache.write(k[mine], v[mine], slots)
        local_k, local_v = step_k[split.local_rows], step_v[split.local_rows]
        partial = torch.empty(meta.num_tokens, HEADS, DIM + 1)
        for group in meta.groups:
            held = local_keys(group, split, cache, local_k, local_v)
            out, lse = partial_attention(group, seqs["q"], held, 0.3, window, slopes)
            partial[group.token_rows, :, :DIM], partial[group.token_rows, :, DIM] = out, lse
        parts.append(partial)
    return merge_partials(torch.stack(parts)).reshape(meta.num_tokens, HEADS * DIM)


@pytest.mark.parametrize("tile", [512, 7])  # 7: the prompt chunks' queries attended in several tiles
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize(("window", "alibi"), [(None, False), (5, False), (None, True)])
def test_split_context_equals_whole_cache(ranks, window, alibi, tile, monkeypatch):
    monkeypatch.setattr(context_attention, "QUERY_TILE", tile)
    seqs = _sequences(ranks)
    slopes = alibi_slopes(HEADS) if alibi else None
    torch.testing.assert_close(_split(seqs, ranks, window, slopes), _whole(seqs, window, slopes), atol=1e-5, rtol=1e-5)


def test_the_fused_kernel_equals_the_plain_arithmetic_masked_rows_included():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=generator) for n in (5, 7, 7))
    bias = torch.randn(2, 3, 5, 7, generator=generator)
    bias[:, :, :, 4:] = float("-inf")
    bias[0, :, 2] = float("-inf")  # a query with no key on this rank
    out, lse = attention_with_lse(q, k, v, bias, 0.3)
    ref_out, ref_lse = plain_attention_with_lse(q, k, v, bias, 0.3)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    assert torch.all(out[0, :, 2] == 0) and torch.all(ref_out[0, :, 2] == 0)
    keep = torch.ones_like(lse, dtype=torch.bool)
    keep[0, :, 2] = False
    torch.testing.assert_close(lse[keep], ref_lse[keep], atol=1e-6, rtol=1e-5)


def test_rows_and_slots_follow_the_position():
    # Position p is rank p % 2's; block b of the table holds its positions at slots b * 8 + (p % 16) // 2.
    split = build_context_split(ContextParallel(1, 2), [5, 6, 7, 40], [[2], [2], [2], [9, 4, 3]], BLOCK)
    assert split.local_rows.tolist() == [0, 2]
    assert split.slots.tolist() == [2 * 8 + 2, 2 * 8 + 3]
    assert split.owners.tolist() == [1, 0, 1, 0] and split.index_in_owner.tolist() == [0, 0, 1, 1]
    assert split.key_positions(2).tolist() == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]
    with pytest.raises(ValueError, match="does not split over 3"):
        build_context_split(ContextParallel(0, 3), [0], [[0]], BLOCK)
