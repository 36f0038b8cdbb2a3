"""GPTQ and AWQ safetensors layouts: hand-packed words, round trips, and the forms layers keep."""

from __future__ import annotations

import torch

from folio.weight_formats.checkpoint_layouts import (
    IntGroups,
    contiguous_group_index,
    pack_awq,
    pack_gptq,
    to_kernel_form,
    unpack_awq,
    unpack_gptq,
)
from folio.weight_formats.int4 import Int4Groups
from folio.weight_formats.int8 import ChannelInt8, Int8Groups

GEN = torch.Generator().manual_seed(0)


def _groups(rows, cols, bits, group, zero=None):
    codes = torch.randint(0, 2**bits, (rows, cols), generator=GEN, dtype=torch.uint8)
    if zero is None:
        zeros = torch.randint(0, 2**bits, (rows, cols // group), generator=GEN, dtype=torch.uint8)
    else:
        zeros = torch.full((rows, cols // group), zero, dtype=torch.uint8)
    scales = torch.rand(rows, cols // group, generator=GEN) + 0.01
    return IntGroups(codes, zeros, scales, bits, contiguous_group_index(cols, group))


def test_gptq_packs_codes_along_k_low_bits_first_and_zeros_minus_one():
    codes = torch.arange(1, 9, dtype=torch.uint8).repeat(8, 1)  # every row: k = 0..7 hold 1..8
    groups = IntGroups(codes, torch.full((8, 1), 3, dtype=torch.uint8), torch.ones(8, 1), 4, torch.zeros(8).long())
    tensors = pack_gptq(groups)
    assert tensors["qweight"].shape == (1, 8) and tensors["qweight"].dtype == torch.int32
    assert all(int(w) & 0xFFFFFFFF == 0x87654321 for w in tensors["qweight"][0])
    assert int(tensors["qzeros"][0, 0]) == 0x22222222  # zero point 3 stored as 2 (the v1 format)
    assert tensors["scales"].dtype == torch.float16 and tensors["g_idx"].dtype == torch.int32


def test_awq_packs_columns_in_its_interleaved_order():
    codes = torch.arange(8, dtype=torch.uint8).view(8, 1).repeat(1, 8)  # row n holds code n everywhere
    groups = IntGroups(codes, torch.zeros(8, 1, dtype=torch.uint8), torch.ones(8, 1), 4, torch.zeros(8).long())
    tensors = pack_awq(groups)
    assert tensors["qweight"].shape == (8, 1)  # [K, N / 8]
    assert int(tensors["qweight"][0, 0]) & 0xFFFFFFFF == 0x75316420  # word positions hold n = 0, 2, 4, 6, 1, 3, 5, 7


def test_round_trips_are_exact():
    for bits, group in ((4, 32), (4, 128), (8, 64), (2, 32)):
        groups = _groups(64, 256, bits, group)
        back = unpack_gptq(pack_gptq(groups), bits)
        assert torch.equal(back.codes, groups.codes) and torch.equal(back.zeros, groups.zeros)
        torch.testing.assert_close(back.scales, groups.scales.half().float())
        v2 = unpack_gptq(pack_gptq(groups, zero_offset=0), bits, zero_offset=0)
        assert torch.equal(v2.zeros, groups.zeros)
    groups = _groups(64, 256, 4, 64)
    back = unpack_awq(pack_awq(groups))
    assert torch.equal(back.codes, groups.codes) and torch.equal(back.zeros, groups.zeros)


def test_kernel_forms_dequantize_to_the_same_weight():
    four = _groups(64, 256, 4, 64)
    kept = to_kernel_form(four)
    assert isinstance(kept, Int4Groups) and kept.group_size == 64
    torch.testing.assert_close(kept.dequantize(), four.dequantize(), atol=1e-6, rtol=1e-6)
    channel = _groups(64, 256, 8, 256, zero=128)
    kept = to_kernel_form(channel)
    assert isinstance(kept, ChannelInt8)  # bf16 scales, as the int8 kernel takes them
    torch.testing.assert_close(kept.dequantize(), channel.dequantize(), atol=0, rtol=2**-8)
    grouped = to_kernel_form(_groups(64, 256, 8, 64, zero=128))
    assert isinstance(grouped, Int8Groups) and grouped.group_size == 64


def test_act_order_and_asymmetric_8_bit_fall_back_to_dense():
    shuffled = _groups(64, 256, 4, 64)
    shuffled.group_index = shuffled.group_index[torch.randperm(256, generator=GEN)]
    assert not shuffled.has_contiguous_groups
    dense = to_kernel_form(shuffled)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, shuffled.dequantize())
    g_idx = pack_gptq(shuffled)["g_idx"]
    assert torch.equal(unpack_gptq({**pack_gptq(shuffled), "g_idx": g_idx}, 4).group_index, shuffled.group_index)
    assert isinstance(to_kernel_form(_groups(64, 256, 8, 64)), torch.Tensor)
