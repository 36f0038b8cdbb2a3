"""The compiled paged attention kernel equals the pure-PyTorch paged attention (the oracle) on random
caches: decodes, speculative verifications, and prefill chunks sent to it by the attention layer."""

from __future__ import annotations

import pytest
import torch

from folio import ops
from folio.kv_cache.quant import FORMATS
from folio.layers.attention.alibi import alibi_slopes
from folio.layers.attention.kv_tensors import LayerKV, scale_zeros
from folio.layers.attention.layer import PagedAttention
from folio.layers.attention.metadata import build_attention_metadata
from folio.layers.attention.torch_paged import attend_group
from tests.threads import torch_threads

kernel = ops.load("paged_decode")
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C++ toolchain to build the CPU kernel")


def _random_decode_batch(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    block_size = 4
    lengths = [1, 3, 4, 5, 17, 40, 63]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 5
    perm = torch.randperm(num_blocks, generator=generator).tolist()  # blocks scattered through the pool
    tables, used = [], 0
    for n in lengths:
        count = -(-n // block_size)
        tables.append(perm[used : used + count])
        used += count
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    query = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    meta = build_attention_metadata([n - 1 for n in lengths], [1] * len(lengths), tables, block_size)
    return query, k_cache, v_cache, meta.groups[0], block_size


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_torch_path(heads, window, dtype):
    num_heads, num_kv_heads = heads
    head_dim = 32
    query, k_cache, v_cache, group, block_size = _random_decode_batch(num_heads, num_kv_heads, head_dim, dtype, 0)
    assert group.is_decode
    scale = head_dim**-0.5
    expected = attend_group(group, query, query, query, LayerKV(k_cache, v_cache), block_size, scale, window)
    got = kernel.paged_decode_attention(
        query, k_cache, v_cache, group.block_tables, group.seq_lens, block_size, scale, window or 0, None, None
    ).view(expected.shape)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output rounding
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_adds_alibi_biases_like_the_torch_path(heads, dtype):
    num_heads, num_kv_heads = heads
    head_dim = 32
    query, k_cache, v_cache, group, block_size = _random_decode_batch(num_heads, num_kv_heads, head_dim, dtype, 2)
    scale, slopes = head_dim**-0.5, alibi_slopes(num_heads)
    cache = LayerKV(k_cache, v_cache)
    expected = attend_group(group, query, query, query, cache, block_size, scale, None, slopes)
    plain = attend_group(group, query, query, query, cache, block_size, scale, None)
    got = kernel.paged_decode_attention_alibi(
        query, k_cache, v_cache, group.block_tables, group.seq_lens, block_size, scale, 0, None, None, slopes
    ).view(expected.shape)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert (expected.float() - plain.float()).abs().max() > 0.1  # the biases changed the result


def _quantized_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, name: str) -> LayerKV:
    fmt = FORMATS[name]
    slots, heads = k_cache.shape[:2]
    cache = LayerKV(torch.zeros(k_cache.shape, dtype=fmt.dtype), torch.zeros(v_cache.shape, dtype=fmt.dtype), fmt,
                    scale_zeros(slots, heads, k_cache.device), scale_zeros(slots, heads, k_cache.device))  # fmt: skip
    cache.write(k_cache, v_cache, torch.arange(slots))
    return cache


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_8_bit_cache_round_trips_within_its_precision(name):
    k_cache = torch.randn(64, 2, 32, generator=torch.Generator().manual_seed(1)) * 3
    cache = _quantized_cache(k_cache, k_cache, name)
    table = torch.arange(16).view(1, 16)  # all 16 blocks of 4 slots, in order
    back = cache.gather("k", table, 4, torch.float32)[0]
    relative = ((back - k_cache).abs().amax(-1) / k_cache.abs().amax(-1)).max().item()
    assert relative <= (0.5 / 127 if name == "int8" else 2**-4) + 1e-3  # half a step; e4m3 has 3 mantissa bits


@needs_kernel
@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_reads_an_8_bit_cache_like_the_torch_path(name, heads, dtype):
    num_heads, num_kv_heads = heads
    query, k_cache, v_cache, group, block_size = _random_decode_batch(num_heads, num_kv_heads, 64, dtype, 3)
    cache = _quantized_cache(k_cache, v_cache, name)
    scale = 64**-0.5
    expected = attend_group(group, query, query, query, cache, block_size, scale, None)
    k, v, k_scales, v_scales = cache.kernel_args()
    got = kernel.paged_decode_attention(query, k, v, group.block_tables, group.seq_lens, block_size, scale, 0,
                                        k_scales, v_scales).view(expected.shape)  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    exact = attend_group(group, query, query, query, LayerKV(k_cache, v_cache), block_size, scale, None)
    assert (expected.float() - exact.float()).abs().max().item() < (0.05 if name == "int8" else 0.2)


@pytest.mark.parametrize("window", [None, 3])
def test_a_verification_chunk_attended_as_decode_rows_equals_its_causal_attention(window):
    """Speculative verification attends a request's k + 1 rows as decode rows over one block table;
    that must be exactly the causal attention of the same chunk (every row's K/V is in the cache)."""
    generator = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads, head_dim = 4, 6, 2, 32
    tables = [[3, 0, 5, 1, 7], [2, 6]]
    starts, lens = [13, 2], [5, 4]  # a 5-row verification after 13 keys; another request's 4-row chunk
    shape = (8 * block_size, kv_heads, head_dim)
    cache = LayerKV(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    query = torch.randn(sum(lens), heads, head_dim, generator=generator)
    as_chunks = build_attention_metadata(starts, lens, tables, block_size)
    as_rows = build_attention_metadata(starts, lens, tables, block_size, as_decodes=[True, False])
    assert [g.is_decode for g in as_chunks.groups] == [False, False]
    assert [g.is_decode for g in as_rows.groups] == [True, False] and as_rows.groups[0].num_seqs == 5
    torch.testing.assert_close(as_rows.slot_mapping, as_chunks.slot_mapping)
    scale = head_dim**-0.5
    for chunk_group in as_chunks.groups[:1]:
        rows = chunk_group.token_rows
        q = query[rows]
        expected = attend_group(chunk_group, q, q, q, cache, block_size, scale, window)
        decode_group = as_rows.groups[0]
        torch.testing.assert_close(decode_group.token_rows, rows)
        got = attend_group(decode_group, q, q, q, cache, block_size, scale, window)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        if kernel is not None:
            tables, seq_lens = decode_group.block_tables, decode_group.seq_lens
            fast = kernel.paged_decode_attention(
                q, cache.k, cache.v, tables, seq_lens, block_size, scale, window or 0, None, None
            )
            torch.testing.assert_close(fast.view(expected.shape), expected, atol=1e-5, rtol=1e-5)


def _rows_of_runs(requests, num_heads, num_kv_heads, head_dim, dtype, block_size, seed):
    """A decode group of `requests` (keys before the first row, rows): a request of several rows is a
    speculative verification attended as decode rows (one block table, seq_lens growing by one), one of
    a single row an ordinary decode. Blocks are scattered through the pool."""
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-(start + rows) // block_size) for start, rows in requests]
    num_blocks = sum(counts) + 3
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [perm[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    cache = LayerKV(k_cache, v_cache)
    starts, lens = [start for start, _ in requests], [rows for _, rows in requests]
    meta = build_attention_metadata(starts, lens, tables, block_size, as_decodes=[rows > 1 for rows in lens])
    (group,) = meta.groups
    query = torch.randn(sum(lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, cache, group


@pytest.fixture
def threads(request):
    """Runs the test with request.param intra-op threads (the kernel splits keys across them)."""
    with torch_threads(request.param) as count:
        yield count


# Ordinary decodes of 1, 15, 16, 17 and 300+ keys among verification runs of several lengths: one that
# starts at the first key, one crossing a block boundary, a 7-row one over 330 keys followed by a decode
# one key longer over another table (not part of the run), and 17 rows (longer than one task's run).
MIXED = [(0, 1), (0, 3), (14, 1), (15, 1), (14, 3), (16, 1), (310, 1), (330, 7), (337, 1), (40, 17), (3, 2)]


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("head_dim", [64, 128, 36])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_attends_verification_runs_among_decodes_like_the_torch_path(
    threads, head_dim, window, alibi, dtype
):
    num_heads, num_kv_heads = 6, 2
    query, cache, group = _rows_of_runs(MIXED, num_heads, num_kv_heads, head_dim, dtype, 16, seed=head_dim)
    scale = head_dim**-0.5
    slopes = alibi_slopes(num_heads) if alibi else None
    expected = attend_group(group, query, query, query, cache, 16, scale, window, slopes)
    args = (query, cache.k, cache.v, group.block_tables, group.seq_lens, 16, scale, window or 0, None, None)
    got = kernel.paged_decode_attention_alibi(*args, slopes) if alibi else kernel.paged_decode_attention(*args)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.view(expected.shape).float(), expected.float(), atol=tolerance, rtol=tolerance)


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3, 4], indirect=True)
@pytest.mark.parametrize("requests", [[(1000, 1)], [(999, 7)], [(300, 1), (500, 4)], [(0, 9)]],
                         ids=["long-row", "long-run", "two", "short-run"])  # fmt: skip
@pytest.mark.parametrize("window", [None, 700])
def test_decode_kernel_splits_a_long_context_across_threads_exactly(threads, requests, window):
    """Few tasks (one sequence, one KV head) split their keys across the threads; the merged partial
    softmax states equal the whole, windowed keys included (a chunk may hold none of a row's keys)."""
    query, cache, group = _rows_of_runs(requests, 4, 1, 64, torch.float32, 16, seed=7)
    scale = 64**-0.5
    expected = attend_group(group, query, query, query, cache, 16, scale, window)
    got = kernel.paged_decode_attention(
        query, cache.k, cache.v, group.block_tables, group.seq_lens, 16, scale, window or 0, None, None
    )
    torch.testing.assert_close(got.view(expected.shape), expected, atol=1e-5, rtol=1e-5)


def _prefill_step(starts, lens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """A step of prefill chunks (keys before each chunk already cached, the chunk's rows), blocks
    scattered through the pool, and a cache whose earlier keys are random."""
    generator = torch.Generator().manual_seed(seed)
    block_size = 16
    counts = [-(-(start + rows) // block_size) for start, rows in zip(starts, lens, strict=True)]
    num_blocks = sum(counts) + 4
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [perm[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    meta = build_attention_metadata(starts, lens, tables, block_size)
    rows = sum(lens)
    q, k, v = (torch.randn(rows, h, head_dim, generator=generator).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))  # fmt: skip
    return meta, block_size, k_cache, v_cache, q, k, v


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_through_the_kernel_equal_the_torch_path(threads, heads, window, alibi, dtype):
    """The attention layer sends prefill chunks to the kernel as rows of runs: a fresh 300-token prompt,
    a 90-row chunk after 70 cached keys and a 5-row one, beside a decode, equal the PyTorch path."""
    num_heads, num_kv_heads = heads
    head_dim = 64
    meta, block_size, k_cache, v_cache, q, k, v = _prefill_step([0, 70, 0, 9], [300, 90, 1, 5], num_heads,
                                                                 num_kv_heads, head_dim, dtype, seed=11)  # fmt: skip
    assert [g.is_decode for g in meta.groups] == [True, False, False, False]
    slopes = alibi_slopes(num_heads) if alibi else None
    outputs = []
    for use_kernel in (True, False):
        layer = PagedAttention(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window, slopes)
        layer.bind_cache(LayerKV(k_cache.clone(), v_cache.clone()), block_size)
        if not use_kernel:
            layer.decode_kernel = None
        outputs.append(layer(q, k, v, meta))
    got, expected = outputs
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output rounding
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_an_8_bit_cache_keeps_prefill_chunks_on_the_torch_path(monkeypatch):
    meta, block_size, k_cache, v_cache, q, k, v = _prefill_step([0], [40], 4, 2, 32, torch.float32, seed=3)
    layer = PagedAttention(4, 2, 32, 32**-0.5)
    layer.bind_cache(_quantized_cache(k_cache, v_cache, "int8"), block_size)
    monkeypatch.setattr(layer, "_decode", lambda *args: pytest.fail("the kernel attended an 8-bit prefill chunk"))
    assert layer(q, k, v, meta).shape == (40, 4 * 32)
