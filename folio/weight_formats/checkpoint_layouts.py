"""The safetensors layouts of GPTQ and AWQ checkpoints (AutoGPTQ / GPTQModel, AutoAWQ "gemm").

Both store a group-quantized weight W[n, k] = (q[n, k] - z[n, g]) * s[n, g] as 32-bit words of packed
codes, but pack it differently:

- GPTQ: `qweight` int32 [K * bits / 32, N], codes packed along K (code k of a word at bit
  (k % per_word) * bits); `qzeros` int32 [G, N * bits / 32], packed along N; `scales` fp16 [G, N];
  `g_idx` int32 [K], the group of each input column (not k // group_size when the checkpoint was made
  with act-order, `desc_act`). The original format ("gptq", v1) stores z - 1; "gptq_v2" stores z.
- AWQ (4-bit only): `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8], both packed along N
  with columns interleaved in the order 0, 2, 4, 6, 1, 3, 5, 7 within each word; `scales` fp16 [G, N];
  no g_idx.

`IntGroups` is the unpacked form; `to_kernel_form` turns it into what folio's kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.weight_formats.int4 import Int4Groups
from folio.weight_formats.int8 import ChannelInt8, Int8Groups

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word position i holds column AWQ_ORDER[i] of its 8


@dataclass
class IntGroups:
    """W[n, k] = (codes[n, k] - zeros[n, group_index[k]]) * scales[n, group_index[k]]."""

    codes: torch.Tensor  # [N, K] uint8, 0 .. 2^bits - 1
    zeros: torch.Tensor  # [N, G] uint8 (integer zero points)
    scales: torch.Tensor  # [N, G] float32
    bits: int
    group_index: torch.Tensor  # [K] int64

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def has_contiguous_groups(self) -> bool:
        """Column k is in group k // group_size (no act-order permutation)."""
        size = self.codes.shape[1] // self.zeros.shape[1]
        return bool(torch.equal(self.group_index, torch.arange(self.codes.shape[1]) // size))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        zeros = self.zeros.float()[:, self.group_index]
        scales = self.scales.float()[:, self.group_index]
        return ((self.codes.float() - zeros) * scales).to(dtype)


def contiguous_group_index(cols: int, group_size: int) -> torch.Tensor:
    return torch.arange(cols) // group_size


def to_kernel_form(groups: IntGroups) -> Int4Groups | ChannelInt8 | Int8Groups | torch.Tensor:
    """The form a layer keeps: 4-bit -> Int4Groups; symmetric 8-bit (every zero 128) -> ChannelInt8 for
    one group per row, else Int8Groups; anything else (act-order groups, other bit widths,
    asymmetric 8-bit) -> a dense float32 tensor."""
    if not groups.has_contiguous_groups:
        return groups.dequantize()
    if groups.bits == 4:
        scales = groups.scales.float()
        # (q - z) * s = (q - 8) * s + (8 - z) * s
        return Int4Groups(groups.codes, scales, (8 - groups.zeros.float()) * scales)
    if groups.bits == 8 and bool((groups.zeros == 128).all()):
        codes = (groups.codes.to(torch.int16) - 128).to(torch.int8)
        if groups.zeros.shape[1] == 1:
            return ChannelInt8(codes, groups.scales.float())
        return Int8Groups(codes, groups.scales.float().contiguous())
    return groups.dequantize()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack `codes` (values < 2^bits) into int32 words along `dim`."""
    per_word = 32 // bits
    moved = codes.to(torch.int64).movedim(dim, -1)
    if moved.shape[-1] % per_word:
        raise ValueError(f"dimension {moved.shape[-1]} is not a multiple of {per_word} codes per word")
    moved = moved.reshape(*moved.shape[:-1], -1, per_word)
    if order is not None:
        moved = moved[..., list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (moved << shifts).sum(dim=-1)
    return _to_int32(words).movedim(-1, dim).contiguous()


def _unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    per_word = 32 // bits
    moved = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    codes = (moved.unsqueeze(-1) >> shifts) & (2**bits - 1)  # [..., words, per_word], word position order
    if order is not None:
        codes = codes[..., [order.index(c) for c in range(per_word)]]
    return codes.reshape(*codes.shape[:-2], -1).movedim(-1, dim).to(torch.uint8)


def pack_gptq(groups: IntGroups, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """GPTQ tensors (without the layer prefix). zero_offset 1 writes the original ("gptq") format."""
    return {
        "qweight": _pack(groups.codes.t(), groups.bits, dim=0),
        "qzeros": _pack((groups.zeros.t().to(torch.int64) - zero_offset) & (2**groups.bits - 1), groups.bits, dim=1),
        "scales": groups.scales.t().to(torch.float16).contiguous(),
        "g_idx": groups.group_index.to(torch.int32),
    }


def unpack_gptq(tensors: dict[str, torch.Tensor], bits: int, zero_offset: int = 1) -> IntGroups:
    codes = _unpack(tensors["qweight"], bits, dim=0).t()  # [N, K]
    zeros = (_unpack(tensors["qzeros"], bits, dim=1).to(torch.int64) + zero_offset) & (2**bits - 1)
    scales = tensors["scales"].float().t()
    group_index = tensors.get("g_idx")
    if group_index is None:
        group_index = contiguous_group_index(codes.shape[1], codes.shape[1] // scales.shape[1])
    return IntGroups(codes.contiguous(), zeros.t().to(torch.uint8).contiguous(), scales.contiguous(), bits,
                     group_index.to(torch.int64))  # fmt: skip


def pack_awq(groups: IntGroups) -> dict[str, torch.Tensor]:
    if groups.bits != 4 or not groups.has_contiguous_groups:
        raise ValueError("the AWQ layout holds 4-bit weights with contiguous groups only")
    return {
        "qweight": _pack(groups.codes.t(), 4, dim=1, order=AWQ_ORDER),
        "qzeros": _pack(groups.zeros.t(), 4, dim=1, order=AWQ_ORDER),
        "scales": groups.scales.t().to(torch.float16).contiguous(),
    }


def unpack_awq(tensors: dict[str, torch.Tensor]) -> IntGroups:
    codes = _unpack(tensors["qweight"], 4, dim=1, order=AWQ_ORDER).t()  # [N, K]
    zeros = _unpack(tensors["qzeros"], 4, dim=1, order=AWQ_ORDER).t()  # [N, G]
    scales = tensors["scales"].float().t()
    group_size = codes.shape[1] // scales.shape[1]
    return IntGroups(codes.contiguous(), zeros.contiguous(), scales.contiguous(), 4,
                     contiguous_group_index(codes.shape[1], group_size))  # fmt: skip
