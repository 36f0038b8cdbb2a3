"""Large tensors come from the heap once the engine has asked glibc to stop mapping them."""

from __future__ import annotations

import ctypes

import pytest
import torch

from folio.memory import reuse_large_allocations


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 on)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def mapped_block_bytes() -> int | None:
    """Bytes glibc holds in blocks it mapped with mmap (mallinfo2's hblkhd); None without glibc 2.33+."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.argtypes, mallinfo2.restype = [], MallInfo2
    return int(mallinfo2().hblkhd)


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
