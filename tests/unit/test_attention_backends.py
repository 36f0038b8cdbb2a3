"""The compiled decode kernel equals the pure-PyTorch paged attention (the oracle) on random caches."""

from __future__ import annotations

import pytest
import torch

from folio.layers.attention.cpu_kernel import load_decode_kernel
from folio.layers.attention.metadata import build_attention_metadata
from folio.layers.attention.torch_paged import attend_group

kernel = load_decode_kernel()
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
    expected = attend_group(group, query, query, query, k_cache, v_cache, block_size, scale, window)
    got = kernel.paged_decode_attention(
        query, k_cache, v_cache, group.block_tables, group.seq_lens, block_size, scale, window or 0
    ).view(expected.shape)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output rounding
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path, monkeypatch):
    import os
    import time

    from folio.layers.attention.cpu_kernel import _build_directory

    monkeypatch.setenv("FOLIO_HOME", str(tmp_path))
    lock = _build_directory() / "lock"
    lock.touch()
    assert _build_directory() and lock.exists()  # a build in progress is left alone
    old = time.time() - 3600
    os.utime(lock, (old, old))
    _build_directory()
    assert not lock.exists()  # an interrupted build's lock no longer blocks every later start
