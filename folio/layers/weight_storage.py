"""How a Linear layer holds its weight: dense, or quantized for a kernel.

A checkpoint may hand a layer its weight already quantized, in one of the row-separable forms folio
has kernels for: 4- and 5-bit groups (`Int4Groups`: GGUF Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K, GPTQ, AWQ), per-channel int8
(`ChannelInt8`), 8-bit groups (`Int8Groups`) or NF4 (`NF4Weight`). Once joined, 4-bit and 8-bit
groups are tiled for their dot-product kernels (`PackedInt4`, `PackedInt8`). The rows of the first three
depend only on their own codes and scales, so the shards of a fused layer (q|k|v, gate|up), which arrive one at a
time, are staged as they come and joined once every row is in: no dense copy of the weight ever
exists. A format whose parts cannot be joined exactly (NF4: its double-quantized scales run across
rows), and shards of different kinds (a GGUF file's q and k in Q5_0 and v in Q8_0), are kept side by
side (`ConcatRows`), each run of one kind joined and tiled for its kernel. Only a dense shard makes
the whole layer dense.
"""

from __future__ import annotations

from typing import Protocol

import torch

from folio.weight_formats.int4 import GROUP_SIZE, Int4Groups, PackedInt4
from folio.weight_formats.int8 import Int8Groups, packed_for_kernel
from folio.weight_formats.int8_dot import GROUP_SIZES


class RowQuantized(Protocol):
    """A quantized [N, K] weight whose rows can be split and joined."""

    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


class QuantizedKernel(Protocol):
    """What a Linear layer multiplies with: `linear(x [M, K], bias) -> [M, N]` in x's dtype."""

    shape: tuple[int, int]

    @property
    def nbytes(self) -> int: ...

    def step_nbytes(self, greedy: bool) -> int:
        """Bytes a decode step reads of it (what MBU counts): less than `nbytes` where it holds a copy
        that only greedy steps read, or that stands in for what they would read."""
        ...

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor: ...

    def load_kernels(self) -> None:
        """Load (building on first use) the compiled kernels its matmuls take, so that a start-up
        compiles them and reports any that fail, not the first request."""


class RowStaging:
    """Rows of a [N, K] weight arriving as quantized parts of one kind, until all N are in."""

    def __init__(self, rows: int) -> None:
        self.parts: dict[int, RowQuantized] = {}
        self.filled = torch.zeros(rows, dtype=torch.bool)

    def put(self, offset: int, part: RowQuantized) -> None:
        self.parts[offset] = part
        self.filled[offset : offset + part.shape[0]] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def dense_rows(self, dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
        """The rows staged so far, dequantized, as (offset, rows): for the fall back to dense."""
        return [(offset, part.dequantize(dtype)) for offset, part in sorted(self.parts.items())]

    def build(self) -> QuantizedKernel:
        """The weight to multiply by. Consecutive parts of one kind and group size join into one kernel
        (the q|k|v of a file in one format: one tiled weight); runs of different kinds (q and k in Q5_0, v
        in Q8_0) or parts that cannot join (NF4) are kept side by side as ConcatRows."""
        runs: list[list[RowQuantized]] = []
        for _, part in sorted(self.parts.items()):
            if runs and _joinable(runs[-1][-1], part):
                runs[-1].append(part)
            else:
                runs.append([part])
        kernels = [_kernel(run[0] if len(run) == 1 else type(run[0]).cat_rows(run)) for run in runs]
        return kernels[0] if len(kernels) == 1 else ConcatRows(kernels)


def _joinable(before: RowQuantized, part: RowQuantized) -> bool:
    same_groups = getattr(before, "group_size", None) == getattr(part, "group_size", None)
    return type(before) is type(part) and hasattr(type(part), "cat_rows") and same_groups


def _kernel(joined: RowQuantized) -> QuantizedKernel:
    if isinstance(joined, Int4Groups):
        return PackedInt4(joined)
    return packed_for_kernel(joined) if isinstance(joined, Int8Groups) else joined  # type: ignore[return-value]


class ConcatRows:
    """A weight held as row blocks of its own, each multiplied by its kernel and the outputs joined."""

    def __init__(self, parts: list[QuantizedKernel]) -> None:
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def step_nbytes(self, greedy: bool) -> int:
        return sum(p.step_nbytes(greedy) for p in self.parts)

    def rows(self, offset: int, size: int) -> QuantizedKernel:
        """The block that is exactly rows [offset, offset + size)."""
        start = 0
        for part in self.parts:
            if (start, part.shape[0]) == (offset, size):
                return part
            start += part.shape[0]
        raise ValueError(f"rows [{offset}, {offset + size}) are not one block of this weight")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([p.linear(x) for p in self.parts], dim=-1)
        return out if bias is None else out + bias

    def load_kernels(self) -> None:
        for part in self.parts:
            part.load_kernels()


def can_pack(rows: int, cols: int, dtype: torch.dtype, device: torch.device, group_size: int = GROUP_SIZE) -> bool:
    """The int4 kernel takes groups of 32 or a multiple of 64; the model must compute in float32 or
    bfloat16."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and group_size in GROUP_SIZES
        and cols % group_size == 0
    )


def can_keep(part: RowQuantized, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a layer of [rows, cols] can hold this part's format as it is."""
    if isinstance(part, Int4Groups):
        return can_pack(rows, cols, dtype, device, part.group_size)
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
