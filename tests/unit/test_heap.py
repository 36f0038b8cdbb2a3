"""Large tensors come from the heap once the engine has asked glibc to stop mapping them."""

from __future__ import annotations

import pytest
import torch

from folio.heap import mapped_block_bytes, reuse_large_allocations


def test_a_large_tensor_is_not_mapped_afresh_after_reuse_large_allocations():
    if mapped_block_bytes() is None:
        pytest.skip("not glibc 2.33+")
    assert reuse_large_allocations()
    before = mapped_block_bytes()
    large = torch.empty(100 << 20, dtype=torch.uint8)  # past glibc's largest mmap threshold (32 MB)
    large.fill_(1)
    assert mapped_block_bytes() == before  # served by the heap
    del large
    again = torch.ones(100 << 20, dtype=torch.uint8)
    assert mapped_block_bytes() == before and int(again[-1]) == 1
